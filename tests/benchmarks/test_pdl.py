"""``benchmarks/pdl.py``: a step's span, busy time and kernel sum come from its device trace as
documented (overlapping kernels count once in span and busy, fully in the sum), its table puts
each measurement in its row, and it refuses to run off the GPU."""

import jax
import pytest

from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("pdl")


def test_step_times_from_the_trace(bench, monkeypatch):
  # Two calls' kernels (ns): 0-4000, 3000-5000 (overlapping: PDL), 6000-7000 after a gap.
  events = [(0, 4000, "a"), (3000, 2000, "b"), (6000, 1000, "c")]
  monkeypatch.setattr(bench.moe_timeline, "device_events", lambda step, *args: events)
  monkeypatch.setattr(bench, "CALLS", 2)
  assert bench.step_us(None) == dict(span=3.5, busy=3.0, sum=3.5)


def test_markdown_rows(bench):
  base = dict(roofline_us=11.7, busy_us=35.5, sum_us=35.6)
  rows = [dict(kind="attention", cell="h8 b1 32k q17", pdl=False, span_us=36.0, span_fraction=11.7 / 36.0,
               sum_fraction=11.7 / 35.6, span_vs_off=1.0, rows="bit-identical", reference_span_us=140.8,
               reference_sum_us=143.1, speedup_span=140.8 / 36.0, **base),
          dict(kind="moe", cell="int4 48e T=1", pdl=True, span_us=14.6, span_fraction=4.3 / 14.6,
               sum_fraction=4.3 / 14.3, span_vs_off=1.015, rows="DIFFER", roofline_us=4.3, busy_us=14.3,
               sum_us=14.3)]
  lines = bench.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, repeats=5,
                              stream_GBps=4674.0, matmul_TFLOPs=827.0, rows=rows)).splitlines()
  assert ("| attention | h8 b1 32k q17 | off | 36.0 | 35.5 | 35.6 | 11.7 | 32.5% | 32.9% | 1.000x | "
          "140.8 / 143.1 | 3.91x | bit-identical |") in lines
  assert "| moe | int4 48e T=1 | on | 14.6 | 14.3 | 14.3 | 4.3 | 29.5% | 30.1% | 1.015x | - | - | DIFFER |" in lines


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))
