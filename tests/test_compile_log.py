"""The compile-log report sums jax's compilation lines per function and per test file."""

from tests import compile_log


def test_report_sums_compilations_and_cache_hits(tmp_path):
  (tmp_path / "1.log").write_text(
      "tests/a.py::t1\tFinished XLA compilation of jit(step) in 4.5 sec\n"
      "tests/a.py::t2\tFinished XLA compilation of jit(step) in 1.5 sec\n"
      "tests/b.py::t\tFinished XLA compilation of jit(add) in 0.05 sec\n"
      "tests/b.py::t\tPersistent compilation cache hit for 'jit_step' with key 'k'\n"
      "tests/b.py::t\tsome other warning\n"
      "tests/d.py::t\tPersistent compilation cache hit for 'jit_add' with key 'k'\n")
  (tmp_path / "notes.txt").write_text("tests/c.py::t\tFinished XLA compilation of jit(x) in 9 sec\n")
  text = compile_log.report(str(tmp_path))
  assert text.splitlines()[0] == "3 compilations, 6 s (0 s in those under 0.2 s); 2 persistent-cache hits"
  assert "    6.0      2  jit(step)" in text and "    0.1      1  jit(add)" in text
  assert "    6.0           0  tests/a.py" in text and "    0.1           1  tests/b.py" in text
  assert text.endswith("    0.0           1  tests/d.py")  # a file with cache hits only
  assert "jit(x)" not in text  # only the plugin's *.log files are read
