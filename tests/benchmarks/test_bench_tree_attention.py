"""``benchmarks/bench_tree_attention.py --resume``: a grid filled over several device calls."""

import json
import sys

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("bench_tree_attention")


def row(heads, batch, cached, q_len, time_us, **extra):
  return dict(heads=heads, batch=batch, cached=cached, q_len=q_len, row_tiles=1, splits=2,
              time_us=time_us, layer_us=time_us - 1, kernel_us=time_us - 2, meta_us=1.0,
              roofline_us=time_us / 2, roofline_fraction=0.5, bytes_per_s=1e12, flops_per_s=1e14,
              partial_dtype="auto", **extra)


def result_file(path, stream, rows, command):
  path.write_text(json.dumps(dict(device="gpu", jax="0.11.2", python="3.12", stream_GBps=stream,
                                  matmul_TFLOPs=800.0, command=command, rows=rows, skipped=[],
                                  variants=[], skipped_variants=[])))
  return path


def test_resume_keeps_cells_tags_runs_and_lists_what_is_missing(bench, tmp_path, monkeypatch):
  first = result_file(tmp_path / "a.json", 4600.0, [
      row(8, 1, 32768, 17, 34.0), row(8, 1, 32768, 9, 29.0),
      dict(heads=8, batch=1, cached=32768, q_len=33, error="RuntimeError: boom"),  # not kept
      row(8, 1, 32768, 65, 80.0, num_splits=4)], "first")  # a variant: not a grid cell
  second = result_file(tmp_path / "b.json", 4700.0, [row(8, 1, 32768, 9, 28.0),
                                                      row(64, 1, 32768, 1, 26.0)], "second")
  runs, kept = bench.load_runs([first, second])
  assert [r["command"] for r in runs] == ["first", "second"]
  by_cell = {bench.cell_of(r): r for r in kept}
  assert set(by_cell) == {(8, 1, 32768, 17), (8, 1, 32768, 9), (64, 1, 32768, 1)}
  assert by_cell[(8, 1, 32768, 9)]["time_us"] == 28.0 and by_cell[(8, 1, 32768, 9)]["run"] == 1
  assert by_cell[(8, 1, 32768, 17)]["run"] == 0

  out = tmp_path / "out"
  monkeypatch.setattr(sys, "argv", [
      "bench", "--resume", str(first), str(second), "--render-only", "--heads", "8", "--batch", "1",
      "--cached", "32768", "--q-len", "9", "17", "33", "--name", "grid", "--out", str(out)])
  bench.main()
  combined = json.loads((out / "grid.json").read_text())
  assert len(combined["runs"]) == 2 and len(combined["rows"]) == 3
  assert [tuple(c) for c in combined["skipped"]] == [(8, 1, 32768, 33)]  # failed: not timed
  text = (out / "grid.md").read_text()
  assert "| run | heads |" in text and "run 1: stream 4700 GB/s" in text
  assert "| 1 | 8 | 1 | 32k | 9 |" in text and "| 0 | 8 | 1 | 32k | 17 |" in text
  assert "Not timed in any run yet: 1 cells: h8/b1/32k/q33" in text

  # A combined file resumes like any other: its rows keep their runs, the next run is appended.
  runs, kept = bench.load_runs([out / "grid.json"])
  assert len(runs) == 2 and {bench.cell_of(r): r["run"] for r in kept}[(8, 1, 32768, 9)] == 1


def test_render_only_needs_resume(bench, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["bench", "--render-only"])
  with pytest.raises(SystemExit):
    bench.main()
