"""``benchmarks/moe_work_list.py``: its variants call the work lists they name, its table puts each
measurement in its row, and it refuses to run off the GPU."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("moe_work_list")


def test_variants_call_the_lists_they_name(bench, monkeypatch):
  seen = []
  monkeypatch.setattr(moe, "moe_experts", lambda x, g, w, **kw: seen.append(kw["work_list_impl"]))
  x, g = jnp.zeros((136, 8), jnp.bfloat16), jnp.zeros(48, jnp.int32)
  for impl in bench.VARIANTS:
    bench.layer(impl)(x, g, None)
  assert seen == ["kernel", "jnp"]
  assert moe.default_work_list_impl(bench.EXPERTS) == "kernel"  # "kernel" is what bench_moe.py times


def test_markdown_rows(bench):
  rows = [dict(experts=48, tokens=17, format="int4", touched=14.1, variant="kernel", gpu_us=126.0, roofline_us=77.0,
               roofline_fraction=77 / 126, glue_us=2.6, kernels={"moe_gate_up_mosaic_gpu_kernel": 85.9},
               vs_jnp=126 / 131.5, rows="bit-identical")]
  text = bench.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, rows=rows))
  assert "| 17 | int4 | 14.1 | kernel | 126.0 | 61% | 2.6 | moe_gate_up 85.9 | 0.958x | bit-identical |" in text.splitlines()


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))
