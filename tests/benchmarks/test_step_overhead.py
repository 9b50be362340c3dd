"""``benchmarks/step_overhead.py``: per-step counts and times from a trace's device events, its table, and
that it refuses to run off the GPU."""

import pytest

from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("step_overhead")


def test_per_step_summary_counts_overlaps_once_and_copies_apart(bench):
  # Two steps: kernels 0-4000 and 3000-5000 (overlapping), 9000-10000; a device-to-host copy, a memset.
  events = [(3000, 2000, "fusion_2"), (0, 4000, "fusion_1"), (9000, 1000, "loop_3"), (6000, 500, "MemcpyDtoH"),
            (11000, 100, "Memset")]
  got = bench.summarize(events, steps=2)
  assert got == {"kernels_per_step": 1.5, "copies_per_step": 1.0, "busy_us_per_step": 3.0, "span_us_per_step": 5.0}


def test_table_puts_each_cell_in_its_row_and_names_failed_variants(bench):
  cell = lambda x: {"tokens_per_s": x, "step_ms": 1.5, "host_ms": 0.9, "raw_step_ms": 0.7, "raw_dispatch_ms": 0.6,
                    "kernels_per_step": 300, "copies_per_step": 7, "busy_us_per_step": 250, "span_us_per_step": 650}
  result = {"device": "H200", "jax": "0.11.2", "argv": ["--out", "x"],
            "rows": [{"variant": "default", "budget 0": cell(662), "budget 16": cell(1400)},
                     {"variant": "graphs from 1 op", "error": "exit 1: Traceback\nValueError: bad | flag"}]}
  table = bench.markdown(result)
  assert "| default | 0 | 662 | 1.500 | 0.900 | 0.700 | 0.600 | 300 | 7.0 | 250 | 650 |" in table
  assert "| default | 16 | 1400 |" in table
  # A child's traceback stays on its row: no line breaks or column bars from it.
  assert "| graphs from 1 op | failed: exit 1: Traceback ValueError: bad / flag |" in table
  assert "python3 benchmarks/step_overhead.py --out x" in table


def test_refuses_to_run_off_the_gpu(bench, monkeypatch):
  with pytest.raises(SystemExit, match="needs a CUDA GPU"):
    run_main(monkeypatch, bench, "--out", "unused")
