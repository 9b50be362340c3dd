"""``benchmarks/level_unroll.py``: its table, with the GPU-only columns left empty on the CPU and a
token mismatch called out."""

from tests.benchmarks import load_benchmark


def test_table_rows_and_a_token_mismatch():
  bench = load_benchmark("level_unroll")
  gpu_row = {"scan": "looped", "batch": 8, "compile_s": 11.26, "tokens_per_s": 7619.4, "raw_step_ms": 1.9601,
             "kernels_per_step": 692.0, "copies_per_step": 210.0, "busy_us_per_step": 1424.75, "same_tokens": True}
  cpu_row = {"scan": "unrolled", "batch": 1, "compile_s": 7.0, "tokens_per_s": 116.3, "raw_step_ms": 21.0,
             "same_tokens": False}
  table = bench.markdown({"device": "H100", "jax": "0.11.2", "argv": ["--out", "x"], "rows": [gpu_row, cpu_row]})
  assert "| looped | 8 | 11.3 | 7619 | 1.960 | 692 | 210 | 1425 | yes |" in table
  assert "| unrolled | 1 | 7.0 | 116 | 21.000 | - | - | - | NO |" in table
  assert "python3 benchmarks/level_unroll.py --out x" in table
