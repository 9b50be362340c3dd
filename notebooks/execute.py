"""Runs notebooks top to bottom in a fresh kernel and saves them with their outputs.

    .venv/bin/python notebooks/execute.py                  # every notebook here
    .venv/bin/python notebooks/execute.py NAME.ipynb ...   # some of them

Each notebook runs with this folder as its working directory; a cell that raises stops it and
leaves the file unchanged. Needs the ``notebook`` or ``test`` extra (nbclient, ipykernel).
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 900


def execute(path: Path) -> nbformat.NotebookNode:
  """The notebook at ``path`` after running every cell (raises ``nbclient`` errors on a failing cell)."""
  notebook = nbformat.read(path, as_version=4)
  NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                 resources={"metadata": {"path": str(HERE)}}).execute()
  return notebook


def main(argv=None):
  names = (sys.argv[1:] if argv is None else argv) or sorted(p.name for p in HERE.glob("*.ipynb"))
  for name in names:
    path = HERE / name
    start = time.perf_counter()
    notebook = execute(path)
    nbformat.write(notebook, path)
    print(f"{name}: ran in {time.perf_counter() - start:.0f} s, saved with its outputs")


if __name__ == "__main__":
  main()
