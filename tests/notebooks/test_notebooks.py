"""Every notebook in ``notebooks/`` runs top to bottom in a fresh kernel (CPU), its own
assertions included (the tree-policy notebook checks that speculative output equals greedy
decoding and that DDTree's tau beats the chain's)."""

import importlib.util
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def _runner():
  spec = importlib.util.spec_from_file_location("notebooks_execute", NOTEBOOKS / "execute.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_notebooks_are_found():
  assert "tree_policies.ipynb" in NAMES  # else the parametrized test below would run nothing


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_without_errors(name):
  stored = (NOTEBOOKS / name).read_bytes()
  executed = _runner().execute(NOTEBOOKS / name)  # raises on a failing cell
  code_cells = [c for c in executed.cells if c.cell_type == "code"]
  assert code_cells and all(c.execution_count is not None for c in code_cells)
  assert not [o for c in code_cells for o in c.outputs if o.output_type == "error"]
  assert (NOTEBOOKS / name).read_bytes() == stored  # the test must not rewrite the repository's file
