"""``benchmarks/moe_split.py``: its variants are the configurations they name, its table puts each
measurement in its row, and it refuses to run off the GPU."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def split():
  return load_benchmark("moe_split")


def int4_share():
  def matrix(n, k):
    return moe.KernelInt4Matrix(jax.ShapeDtypeStruct((48, n, k // 8), jnp.uint32),
                                jax.ShapeDtypeStruct((48, n, k // 32), jnp.bfloat16), k)
  return moe.Int4Experts(matrix(2048, 7168), matrix(2048, 7168), matrix(7168, 2048))


def test_variants_are_the_configurations_they_name(split):
  default = moe.default_tiles(int4_share(), expected_rows=1)  # the share at T = 1: gate/up split
  assert default.gate_up.split_k
  int4 = split.variants("int4")
  assert list(int4) == ["default", "no split", "split", "full grid", "one sum, full grid"]
  adjust, item_programs = int4["no split"]
  assert item_programs is None and not adjust(default).gate_up.split_k
  assert adjust(default).gate_up.chunk_k == moe.CHUNK_K  # the same chunks: the same rows
  nine = moe.default_tiles(int4_share(), expected_rows=9)  # T = 9: 8.6 experts x 32 tiles > 132 SMs
  assert not nine.gate_up.split_k
  adjust, item_programs = int4["split"]
  assert item_programs is None and adjust(nine).gate_up.split_k and adjust(nine).gate_up.chunk_k == moe.CHUNK_K
  assert not adjust(nine).down.split_k
  adjust, item_programs = int4["one sum, full grid"]
  assert item_programs == split.FULL_GRID and adjust(default).gate_up.chunk_k is None
  assert adjust(default).gate_up.block_k == default.gate_up.block_k
  assert list(split.variants("bf16")) == ["default", "full grid"]


def test_merge_keeps_other_cells_and_replaces_timed_ones(split):
  def row(fmt, e, t, us):
    return dict(format=fmt, experts=e, tokens=t, variant="default", gpu_us=us)
  earlier = [row("int4", 48, 1, 20.0), row("int4", 48, 9, 90.0), row("bf16", 48, 1, 30.0)]
  merged = load_benchmark("results_io").merge_rows(earlier, [row("int4", 48, 9, 88.0), row("int4", 384, 1, 70.0)],
                                                   split.cell)
  assert [(r["format"], r["experts"], r["tokens"], r["gpu_us"]) for r in merged] == [
      ("bf16", 48, 1, 30.0), ("int4", 48, 1, 20.0), ("int4", 48, 9, 88.0), ("int4", 384, 1, 70.0)]


def test_markdown_rows(split):
  rows = [dict(experts=48, tokens=1, format="int4", touched=0.8, variant="default", gpu_us=19.0, vs_default=1.0,
               kernels={"moe_gate_up_mosaic_gpu_kernel": 8.8, "moe_fold_mosaic_gpu_kernel": 2.0}, rows="-"),
          dict(experts=48, tokens=1, format="int4", touched=0.8, variant="one sum, full grid", gpu_us=23.0,
               vs_default=23 / 19, kernels={"moe_gate_up_mosaic_gpu_kernel": 14.1}, rows="rel L2 1.0e-03")]
  text = split.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, rows=rows))
  lines = text.splitlines()
  assert "| 48 | 1 | int4 | 0.8 | default | 19.0 | 1.00x | moe_gate_up 8.8, moe_fold 2.0 | - |" in lines
  assert "| 48 | 1 | int4 | 0.8 | one sum, full grid | 23.0 | 1.21x | moe_gate_up 14.1 | rel L2 1.0e-03 |" in lines


def test_refuses_to_run_off_the_gpu(split, monkeypatch):
  with pytest.raises(SystemExit, match="GPU"):
    run_main(monkeypatch, split)


def test_unknown_variant_is_refused_by_name(split, monkeypatch, capsys):
  with pytest.raises(SystemExit):
    run_main(monkeypatch, split, "--formats", "bf16", "--variants", "split")
  assert "['split']: not variants of ['bf16']" in capsys.readouterr().err
