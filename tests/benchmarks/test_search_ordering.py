"""``benchmarks/search_ordering.py``: its table and ratios, a token mismatch called out, and the
measurement itself refused off the GPU (where both forms sort)."""

import sys

import pytest

from tests.benchmarks import load_benchmark


def test_table_ratios_and_a_token_mismatch():
  bench = load_benchmark("search_ordering")
  row = lambda ordering, raw, busy, same=True: {
      "budget": 16, "batch": 8, "ordering": ordering, "compile_s": 10.04, "tokens_per_s": 8976.2, "raw_step_ms": raw,
      "kernels_per_step": 594.0, "copies_per_step": 207.0, "busy_us_per_step": busy, "same_tokens": same}
  lone = dict(row("sort", 2.0, 900.0), budget=32, batch=1)  # no pairwise row: no ratio
  table = bench.markdown({"device": "H200", "jax": "0.11.2", "argv": ["--out", "x"],
                          "rows": [row("sort", 1.6, 1300.0), row("pairwise", 1.2, 1040.0, same=False), lone]})
  assert "| 16 | 8 | sort | 10.0 | 8976 | 1.600 | 594 | 207 | 1300 | yes |" in table
  assert "| 16 | 8 | pairwise | 10.0 | 8976 | 1.200 | 594 | 207 | 1040 | NO |" in table
  assert "budget 16 batch 8: 0.75x, 0.80x." in table and "budget 32" not in table.split("Ratios")[1]
  assert "python3 benchmarks/search_ordering.py --out x" in table


def test_refuses_to_run_off_the_gpu(monkeypatch):
  bench = load_benchmark("search_ordering")
  monkeypatch.setattr(sys, "argv", ["search_ordering.py"])
  with pytest.raises(SystemExit, match="compares GPU step times"):
    bench.main()
