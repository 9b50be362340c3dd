"""``benchmarks/moe_per_row_grid.py``: its variants call the grids they name on the token's pairs,
its table puts each measurement in its row, and it refuses to run off the GPU."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("moe_per_row_grid")


def test_variants_call_the_grids_they_name(bench, monkeypatch):
  seen = []
  monkeypatch.setattr(moe, "moe_experts_per_row", lambda t, i, w, **kw: seen.append((i.shape, kw)))
  for g in bench.GRIDS:
    bench.layer(g, 2)(jnp.zeros((1, 8), jnp.bfloat16), jnp.zeros((1, 8), jnp.int32), None)
  assert seen == [((1, 8), dict(expected_rows=2, item_programs=g)) for g in bench.GRIDS]
  assert bench.GRIDS[0] == bench.PAIRS and all(g < bench.PAIRS for g in bench.GRIDS[1:])  # the baseline first


def test_markdown_rows(bench):
  rows = [dict(experts=48, tokens=1, touched=0.81, format="bf16", item_programs=8, default=False, gpu_us=26.8,
               roofline_us=15.8, roofline_fraction=15.8 / 26.8, kernels={"moe_gate_up_mosaic_gpu_kernel": 18.3},
               vs_default=1.0, rows="bit-identical"),
          dict(experts=96, tokens=1, touched=1.93, format="int4", item_programs=2, default=True, gpu_us=15.0,
               roofline_us=4.4, roofline_fraction=4.4 / 15.0, kernels={"moe_down_mosaic_gpu_kernel": 5.0},
               vs_default=0.9, rows="DIFFER")]
  text = bench.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, repeats=5, rows=rows))
  lines = text.splitlines()
  assert "| 48 | 0.81 | bf16 | 8 | 26.8 | 59.0% | moe_gate_up 18.3 | 1.000x | bit-identical |" in lines
  assert "| 96 | 1.93 | int4 | **2** (default) | 15.0 | 29.3% | moe_down 5.0 | 0.900x | DIFFER |" in lines
  assert "the median of 5 timings" in text


def test_rejects_grids_without_the_baseline_and_bad_counts(bench, monkeypatch, capsys):
  for grids in (["4", "2"], ["8", "9"], ["8", "0"]):
    with pytest.raises(SystemExit):
      run_main(monkeypatch, bench, "--grids", *grids)
    assert "--grids must be in [1, 8] and include 8" in capsys.readouterr().err
  for args, message in ((["--repeats", "0"], "--repeats must be >= 1, got 0"),
                        (["--experts", "48", "0"], "--experts must be >= 1, got 0")):
    with pytest.raises(SystemExit):
      run_main(monkeypatch, bench, *args)
    assert message in capsys.readouterr().err


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))


def test_main_marks_the_default_grid_and_compares_rows_with_a_program_per_pair(bench, tmp_path, monkeypatch):
  share, timing = bench.moe_share, bench.bench
  monkeypatch.setattr(bench.results_io, "require_gpu", lambda script: None)
  monkeypatch.setattr(timing, "ceilings", lambda: {"stream_read_bytes_per_s": 4e12})
  monkeypatch.setattr(timing, "make_bf16", lambda key, experts: None)
  monkeypatch.setattr(share, "pair_cell", lambda experts: share.Cell([], 0.8, experts // 48))

  def fake_time_variants(layers, cell, w, repeats):  # G = 3 rounds differently
    return {g: share.Timed(20.0 + g, {}, np.full(2, 1.0 if g != 3 else 2.0)) for g in layers}
  monkeypatch.setattr(share, "time_variants", fake_time_variants)
  run_main(monkeypatch, bench, "--out", str(tmp_path), "--formats", "bf16", "--experts", "48", "192",
           "--grids", "8", "4", "3", "2")
  rows = json.loads((tmp_path / "moe_per_row_grid.json").read_text())["rows"]
  marks = [(r["experts"], r["item_programs"]) for r in rows if r["default"]]
  assert marks == [(48, 2), (192, 4)]  # moe.default_pair_programs(8, 1) and (8, 4)
  assert [r["rows"] for r in rows[:4]] == ["bit-identical", "bit-identical", "DIFFER", "bit-identical"]
  assert rows[3]["vs_default"] == pytest.approx(22.0 / 28.0)
