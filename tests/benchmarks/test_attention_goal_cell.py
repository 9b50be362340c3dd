"""``benchmarks/attention_goal_cell.py``: a call's time is its kernels' sum from one device trace,
its table puts each ratio in its row, and it refuses to run off the GPU."""

import jax
import pytest

from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("attention_goal_cell")


def test_call_time_is_the_kernels_sum(bench, monkeypatch):
  monkeypatch.setattr(bench.moe_timeline, "device_events", lambda fn, *args: [(0, 3000, "a"), (9000, 500, "b")])
  assert bench.call_us(None) == 3.5


def test_markdown_rows(bench):
  row = dict(heads=8, batch=1, cached=32768, q_len=17, slots=4, calls=12, kernel_call_us=34.6, kernel_layer_us=33.0,
             reference_one_slot_us=168.7, reference_serving_pool_us=194.3, max_abs_err=2.9e-4)
  for ref in ("reference_one_slot", "reference_serving_pool"):
    for kernel in ("kernel_call", "kernel_layer"):
      row[f"{ref}_over_{kernel}"] = row[f"{ref}_us"] / row[f"{kernel}_us"]
  lines = bench.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0,
                              rows=[row])).splitlines()
  assert "| kernel, whole call (metadata inside) | 34.6 | 4.88x | 5.62x |" in lines
  assert "| kernel, per layer (metadata prepared once a step) | 33.0 | 5.11x | 5.89x |" in lines
  assert "| reference, 4-slot pool of the same length | 194.3 | - | - |" in lines


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))
