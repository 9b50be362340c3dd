"""``benchmarks/bench_top_k.py``'s table: the speedup at the default chunk, the fastest chunk and a
mismatch in ids called out."""

from tests.benchmarks import load_benchmark


def test_table_speedup_best_chunk_and_a_mismatch():
  bench = load_benchmark("bench_top_k")
  row = lambda chunk, us, default=False, same=True, rows=15: {
      "use": "drafter", "rows": rows, "k": 32, "chunk": chunk, "default": default, "gpu_us": us,
      "same_ids_as_lax": same, "kernels": {}}
  rows = [row("lax", 500.0), row(64, 50.0, default=True), row(32, 40.0), row(512, 90.0),
          row("lax", 100.0, rows=60), row(64, 25.0, default=True, rows=60), row(128, 30.0, same=False, rows=60)]
  table = bench.markdown({"device": "H200", "jax": "0.11.2", "command": "python3 benchmarks/bench_top_k.py", "rows": rows})
  assert "| drafter | 15 | 32 | 500.0 | 50.0 (64) | 10.0x | 40.0 (32) | yes |" in table
  assert "| drafter | 60 | 32 | 100.0 | 25.0 (64) | 4.0x | 25.0 (64) | NO |" in table
  assert "Command: `python3 benchmarks/bench_top_k.py`" in table
