"""``benchmarks/moe_dequant_form.py``: its variants call the forms and grids they name, its table
puts each measurement in its row, and it refuses to run off the GPU."""

import math

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("moe_dequant_form")


def test_variants_call_the_forms_and_grids_they_name(bench, monkeypatch):
  seen = []
  monkeypatch.setattr(moe, "moe_experts", lambda x, g, w, **kw: seen.append(kw))
  x, g = jnp.zeros((136, 8), jnp.bfloat16), jnp.zeros(48, jnp.int32)
  for form in bench.FORMS:
    for scale in bench.GRID_SCALES:
      bench.layer(form, bench.item_programs(scale, 17), 17)(x, g, None)
  touched = moe.expected_touched(48, 17)  # ~14.4
  assert [(kw["int4_dequant"], kw["item_programs"], kw["expected_rows"]) for kw in seen] == [
      ("registers", None, 17), ("registers", math.ceil(2 * touched), 17),
      ("registers_serial", None, 17), ("registers_serial", math.ceil(2 * touched), 17)]
  assert bench.item_programs(1.25, 1) == moe.ITEM_PROGRAMS_MIN  # never below the grid's minimum


def test_markdown_rows(bench):
  rows = [dict(experts=48, tokens=17, touched=14.1, form="registers_serial", grid_scale=None, item_programs=29,
               default=True, gpu_us=123.2, roofline_us=77.0, roofline_fraction=77 / 123.2,
               kernels={"moe_gate_up_mosaic_gpu_kernel": 82.6}, vs_default=1.0, rows="bit-identical"),
          dict(experts=48, tokens=17, touched=14.1, form="registers", grid_scale=1.25, item_programs=19,
               default=False, gpu_us=126.9, roofline_us=77.0, roofline_fraction=77 / 126.9,
               kernels={"moe_gate_up_mosaic_gpu_kernel": 86.4}, vs_default=126.9 / 123.2, rows="DIFFER")]
  lines = bench.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, rows=rows)).splitlines()
  default_row = "| 17 | 14.1 | registers_serial (default) | 29 | 123.2 | 62.5% | moe_gate_up 82.6 | 1.000x | bit-identical |"
  assert default_row in lines
  assert "| 17 | 14.1 | registers | 19 | 126.9 | 60.7% | moe_gate_up 86.4 | 1.030x | DIFFER |" in lines


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))
