"""``benchmarks/moe_two_warpgroups.py``: its kernel lowers for the GPU at K2.6's widths, its table
puts each time in its cell, and it refuses to run off the GPU."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def two_wg():
  return load_benchmark("moe_two_warpgroups")


def test_kernel_lowers_for_cuda_at_kimi_widths(two_wg):
  def matrix(n, k):
    return moe.KernelInt4Matrix(jax.ShapeDtypeStruct((4, n, k // 8), jnp.uint32),
                                jax.ShapeDtypeStruct((4, n, k // 32), jnp.bfloat16), k)
  experts = moe.Int4Experts(matrix(2048, 7168), matrix(2048, 7168), matrix(7168, 2048))
  x = jax.ShapeDtypeStruct((two_wg.ROWS, 7168), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((3,), jnp.int32)
  fn = jax.jit(two_wg.variants(stages=(4,))["two warpgroups, 4 stages"])
  text = fn.trace(x, ids, experts).lower(lowering_platforms=("cuda",)).as_text()
  assert "moe_gate_up_two_wg" in text


def test_markdown_cells(two_wg):
  rows = [dict(variant="committed, registers", items=1, gpu_us=26.6),
          dict(variant="committed, registers", items=8, gpu_us=41.7),
          dict(variant="two warpgroups, 4 stages", items=8, gpu_us=48.7)]
  text = two_wg.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0,
                              rows_check="bit-identical", rows=rows))
  lines = text.splitlines()
  assert "| variant | n=1 | n=8 |" in lines
  assert "| committed, registers | 26.6 | 41.7 |" in lines
  assert "| two warpgroups, 4 stages |  | 48.7 |" in lines
  assert "bit-identical" in text


def test_refuses_to_run_off_the_gpu(two_wg, monkeypatch):
  with pytest.raises(SystemExit, match="GPU"):
    run_main(monkeypatch, two_wg)


def test_bad_stages_are_refused_by_name(two_wg, monkeypatch, capsys):
  with pytest.raises(SystemExit):
    run_main(monkeypatch, two_wg, "--stages", "1")
  assert "--stages must be in [2, 8]" in capsys.readouterr().err
