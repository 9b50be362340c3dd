"""A benchmark's results on disk: NAME.json and NAME.md, and the rows of an earlier run kept for the
cells this run did not time (``--merge``)."""

import json
import platform
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


def save_rows(rows: list, *, out: Path, name: str, command: str, start: float, markdown, merge: bool, cell) -> dict:
  """Writes out/NAME.json and out/NAME.md (``markdown(result)``) for ``rows`` timed since ``start``
  (``time.perf_counter()``); with ``merge``, the rows of an earlier NAME.json for other cells are
  kept and its command is named first. Returns the result written."""
  json_path, md_path = out / f"{name}.json", out / f"{name}.md"
  if merge and json_path.exists():
    earlier = json.loads(json_path.read_text())
    rows, command = merge_rows(earlier["rows"], rows, cell), f"{earlier['command']}; then {command}"
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, host=platform.node(),
                command=command, seconds=time.perf_counter() - start, rows=rows)
  out.mkdir(parents=True, exist_ok=True)
  json_path.write_text(json.dumps(result, indent=1))
  md_path.write_text(markdown(result))
  return result
