"""``benchmarks/moe_chunk_k.py``: its variants call the chunk sizes and splits they name, its table
puts each measurement in its row, and it refuses to run off the GPU."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("moe_chunk_k")


def test_variants_call_the_chunks_and_splits_they_name(bench, monkeypatch):
  seen = []
  monkeypatch.setattr(moe, "moe_experts_per_row", lambda t, i, w, **kw: seen.append(("pairs", kw)))
  monkeypatch.setattr(moe, "moe_experts", lambda x, g, w, **kw: seen.append(("sorted", kw)))
  for kind in ("split", "sorted"):
    for chunk_k, split in bench.variants(kind).values():
      bench.layer(kind, bench.gate_up_tiles(chunk_k, split), 3)(jnp.zeros((1, 8)), jnp.zeros((1, 8)), None)
  got = [(entry, kw["expected_rows"], kw["tiles"].gate_up.chunk_k, kw["tiles"].gate_up.split_k) for entry, kw in seen]
  assert got == [("pairs", 3, 1024, True), ("pairs", 3, 1792, True), ("pairs", 3, 3584, True),
                 ("pairs", 3, 1024, False), ("sorted", 3, 1024, False), ("sorted", 3, 1792, False),
                 ("sorted", 3, 3584, False), ("sorted", 3, None, False)]
  # Only the gate/up tiles change: the rest is the INT4 default.
  assert all(kw["tiles"].down == moe.INT4_TILES.down and kw["tiles"].gate_up.block_k == moe.INT4_TILES.gate_up.block_k
             for _, kw in seen)


def test_markdown_rows(bench):
  rows = [dict(kind="split", experts=48, tokens=1, touched=0.81, variant="split 1024", gpu_us=15.6, roofline_us=4.4,
               roofline_fraction=4.4 / 15.6, kernels={"moe_fold_mosaic_gpu_kernel": 2.1}, vs_first=1.0, rel_l2=0.0),
          dict(kind="sorted", experts=48, tokens=9, touched=8.56, variant="one sum", gpu_us=81.1, roofline_us=46.5,
               roofline_fraction=46.5 / 81.1, kernels={"moe_gate_up_mosaic_gpu_kernel": 53.1}, vs_first=0.97,
               rel_l2=7.5e-4)]
  text = bench.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, repeats=5, rows=rows))
  lines = text.splitlines()
  assert "| split | 48 | 1 | 0.81 | split 1024 | 15.6 | 28.2% | moe_fold 2.1 | 1.000x | 0.0e+00 |" in lines
  assert "| sorted | 48 | 9 | 8.56 | one sum | 81.1 | 57.3% | moe_gate_up 53.1 | 0.970x | 7.5e-04 |" in lines
  assert bench.cell(rows[1]) == ("sorted", 48, 9, 3)


def test_repeats_below_one_are_refused(bench, monkeypatch, capsys):
  with pytest.raises(SystemExit):
    run_main(monkeypatch, bench, "--repeats", "0")
  assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))


def test_main_writes_a_row_per_cell_and_variant(bench, tmp_path, monkeypatch):
  """The script's glue on the CPU: cells, variants, roofline and distances from the first variant,
  with the timing and the kernels faked."""
  share, timing = bench.moe_share, bench.bench
  monkeypatch.setattr(bench.results_io, "require_gpu", lambda script: None)
  monkeypatch.setattr(timing, "ceilings", lambda: {"stream_read_bytes_per_s": 4e12})
  monkeypatch.setattr(timing, "make_int4", lambda key, experts: None)
  monkeypatch.setattr(share, "pair_cell", lambda experts: share.Cell([], experts / 48, 1))
  monkeypatch.setattr(share, "sorted_cell", lambda experts, tokens: share.Cell([], float(tokens), tokens))

  def fake_time_variants(layers, cell, w, repeats):
    return {name: share.Timed(10.0 + i, {"k": 1.0}, np.full(4, 1.0 + i)) for i, name in enumerate(layers)}
  monkeypatch.setattr(share, "time_variants", fake_time_variants)
  run_main(monkeypatch, bench, "--out", str(tmp_path), "--repeats", "2")
  result = json.loads((tmp_path / "moe_chunk_k.json").read_text())
  rows = result["rows"]
  assert result["repeats"] == 2 and len(rows) == 2 * 4 + 2 * 4
  assert [(r["kind"], r["experts"], r["tokens"]) for r in rows[::4]] == [("split", 48, 1), ("split", 96, 1),
                                                                         ("sorted", 48, 9), ("sorted", 48, 17)]
  third = rows[2]  # split 3584 at 48 experts: 12 us, rows 3 against 1
  assert third["variant"] == "split 3584" and third["vs_first"] == pytest.approx(1.2)
  assert third["rel_l2"] == pytest.approx(2.0)
  assert third["roofline_us"] == pytest.approx(timing.weight_bytes("int4", 1.0) / 4e12 * 1e6)
  assert (tmp_path / "moe_chunk_k.md").read_text().count("\n| split |") == 8
