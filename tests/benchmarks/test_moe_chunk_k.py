"""``benchmarks/moe_chunk_k.py``: its variants call the chunk sizes and splits they name, its table
puts each measurement in its row, and it refuses to run off the GPU."""

import jax
import jax.numpy as jnp
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


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))
