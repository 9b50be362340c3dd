"""Tests of the benchmark scripts' CPU-side logic (resume, tables), on results they are handed."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
  """The script ``benchmarks/<name>.py`` as a module; the scripts import their siblings
  (``gpu_timing``, ``bench_moe``) by name, so ``benchmarks/`` is on the path while it loads."""
  sys.path.insert(0, str(BENCHMARKS))
  try:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(BENCHMARKS))
  return module


def run_main(monkeypatch, module, *args):
  """``module.main()`` under the command line ``<module>.py *args``."""
  monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *args])
  module.main()
