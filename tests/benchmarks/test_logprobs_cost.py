"""``benchmarks/logprobs_cost.py``: its tables, the ratio against logprobs off per batch, the
GPU-only columns left empty on the CPU and a token mismatch called out."""

from tests.benchmarks import load_benchmark


def test_tables_ratios_and_a_token_mismatch():
  bench = load_benchmark("logprobs_cost")
  row = lambda setting, batch, raw, same=True, **extra: {
      "logprobs": setting, "batch": batch, "compile_s": 9.0, "tokens_per_s": 2000.0, "raw_step_ms": raw,
      "same_tokens": same, **extra}
  engine_rows = [row(None, 1, 1.0, busy_us_per_step=900.0), row(5, 1, 1.25, busy_us_per_step=950.4),
                 row(None, 16, 2.0), row(20, 16, 3.0, same=False)]
  k2 = [{"batch": 4, "nodes": 17, "top_n": n, "gpu_us": us, "kernels": {}} for n, us in ((0, 10.0), (5, 31.26), (20, 80.0))]
  table = bench.markdown({"device": "H100", "jax": "0.11.2", "argv": ["--out", "x"], "engine": engine_rows, "k2": k2})
  assert "| off | 1 | 9.0 | 2000 | 1.000 | 1.000x | 900 | yes |" in table
  assert "| 5 | 1 | 9.0 | 2000 | 1.250 | 1.250x | 950 | yes |" in table
  assert "| 20 | 16 | 9.0 | 2000 | 3.000 | 1.500x | - | NO |" in table
  assert "| 4 | 17 | 10.0 | 31.3 | 80.0 |" in table
  assert "python3 benchmarks/logprobs_cost.py --out x" in table
  cpu = bench.markdown({"device": "cpu", "jax": "0.11.2", "argv": [], "engine": engine_rows[:2], "k2": []})
  assert "K2.6's vocabulary" not in cpu
