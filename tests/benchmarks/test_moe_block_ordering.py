"""``benchmarks/moe_block_ordering.py``: its two tables and ratios, a mismatch called out, and the
measurement refused off the GPU."""

import sys

import pytest

from tests.benchmarks import load_benchmark


def test_tables():
  bench = load_benchmark("moe_block_ordering")
  result = {"device": "H100", "jax": "0.11.2", "argv": ["--out", "x"], "max_pairwise": 2048,
            "orders": [{"n": 136, "sort_us": 12.0, "pairwise_us": 3.0, "same": True}],
            "blocks": [{"tokens": 17, "rows": 136, "sort_us": 300.0, "sort_sort_us": 9.5, "pairwise_us": 291.0,
                        "same": False}]}
  table = bench.markdown(result)
  assert "| 136 | 12.0 | 3.0 | 0.25x | yes |" in table
  assert "| 17 | 136 | 300.0 | 9.5 | 291.0 | 0.97x | NO |" in table
  assert "= 0 (sort) against 2048" in table and "moe_block_ordering.py --out x" in table


def test_refuses_to_run_off_the_gpu(monkeypatch):
  bench = load_benchmark("moe_block_ordering")
  monkeypatch.setattr(sys, "argv", ["moe_block_ordering.py"])
  with pytest.raises(SystemExit, match="times GPU kernels"):
    bench.main()
