"""A benchmark's results on disk: NAME.json and NAME.md, and the rows of an earlier run kept for the
cells this run did not time (``--merge``)."""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax


def kernel_shares(kernels: dict) -> str:
  """'moe_gate_up 54.5, moe_down 24.7': a call's Mosaic GPU kernels and their us, for a table cell."""
  return ", ".join(f"{name.replace('_mosaic_gpu_kernel', '')} {us:.1f}" for name, us in kernels.items())


def merge_rows(earlier: list, new: list, cell) -> list:
  """``new`` plus the rows of ``earlier`` whose cell (``cell(row)``, a sortable tuple) ``new``
  lacks, in cell order."""
  timed = {cell(row) for row in new}
  return sorted([row for row in earlier if cell(row) not in timed] + new, key=cell)


def save_rows(rows: list, *, out: Path, name: str, command: str, start: float, markdown, merge: bool, cell,
              **fields) -> dict:
  """Writes out/NAME.json and out/NAME.md (``markdown(result)``) for ``rows`` timed since ``start``
  (``time.perf_counter()``), with ``fields`` (the run's settings) beside them; with ``merge``, the
  rows of an earlier NAME.json for other cells are kept and its command is named first. Returns the
  result written."""
  json_path, md_path = out / f"{name}.json", out / f"{name}.md"
  if merge and json_path.exists():
    earlier = json.loads(json_path.read_text())
    rows, command = merge_rows(earlier["rows"], rows, cell), f"{earlier['command']}; then {command}"
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, host=platform.node(),
                command=command, seconds=time.perf_counter() - start, **fields, rows=rows)
  out.mkdir(parents=True, exist_ok=True)
  json_path.write_text(json.dumps(result, indent=1))
  md_path.write_text(markdown(result))
  return result


def results_parser(doc: str, name: str, merge: bool = False) -> argparse.ArgumentParser:
  """A timing script's parser with ``--out`` (the results' folder) and ``--name`` (NAME.json,
  NAME.md; default ``name``), and with ``merge`` also ``--merge`` (``save_rows``'s)."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  parser.add_argument("--name", default=name, help="the results' file name (NAME.json, NAME.md)")
  if merge:
    parser.add_argument("--merge", action="store_true", help="keep the rows of --out's NAME.json for other cells")
  return parser


def check_positive(parser: argparse.ArgumentParser, **values) -> None:
  """Exits with a usage error naming the first of ``values`` (option name -> int) below 1."""
  for name, value in values.items():
    if value < 1:
      parser.error(f"--{name} must be >= 1, got {value}")


def require_gpu(script: str) -> None:
  """Exits with a message naming ``script`` unless jax runs on a GPU (the scripts time GPU kernels)."""
  if jax.default_backend() != "gpu":
    sys.exit(f"{script} times the Mosaic GPU kernels: run it on the GPU")


def with_command(lines: list, result: dict) -> str:
  """The markdown ``lines`` of a table, then the command that made ``result`` and its seconds."""
  return "\n".join(lines + ["", f"Command: `{result['command']}` ({result['seconds']:.0f} s)."]) + "\n"
