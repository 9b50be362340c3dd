"""The DDTree policy's orderings by ``lax.sort`` against pairwise ranks, in one process: demo-pair steps.

    PYTHONPATH=. python3 benchmarks/search_ordering.py --out benchmarks/results     # GPU

``policies._layered_search`` orders candidates twice a drafter position and once over all of them.
On the GPU it now compares every pair of a set (``models.ordering``, up to
``policies.RANK_SELECT_MAX`` elements) instead of running ``lax.sort``, which XLA runs as a copy of
every operand into its output and a few kernels. For both forms (``sort``: ``RANK_SELECT_MAX`` = 0,
every ordering of the search by ``lax.sort``, as before; the rest of the step as it is), at the budgets and batches below (bf16, greedy, held-out prompts): the
decoder's compile time, tokens/s of one ``generate`` of 128 new tokens after a warm-up, the raw step
(40 dispatched without reading them), the kernels, copies and busy time per step from a trace of 8
engine steps, and whether the two forms' tokens are identical. Writes ``search_ordering.{json,md}``.
"""

import argparse
import json
import pathlib
import sys

import jax

import level_unroll
from ddtree_jax import policies

CELLS = ((16, 1), (16, 8), (32, 1), (8, 8))  # (budget, batch): the server's default table's pairs


def markdown(result: dict) -> str:
  lines = [f"# The DDTree policy's orderings: lax.sort against pairwise ranks ({result['device']}, jax {result['jax']})",
           "", f"Demo pair, bf16, greedy; raw: {level_unroll.RAW_STEPS} steps dispatched without reading them; "
           f"kernels, copies and busy time per step from a trace of {level_unroll.TRACE_STEPS} engine steps.", "",
           "| budget | batch | ordering | compile s | tok/s | raw step ms | kernels | copies | busy us | tokens as sorted |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    lines.append(f"| {row['budget']} | {row['batch']} | {row['ordering']} | {level_unroll.step_cells(row)} |")
  lines += ["", "Ratios, pairwise / sort (raw step, busy): " + ", ".join(
      f"budget {b} batch {n}: {r['raw_step_ms'] / s['raw_step_ms']:.2f}x, "
      f"{r.get('busy_us_per_step', float('nan')) / s.get('busy_us_per_step', float('nan')):.2f}x"
      for (b, n), (s, r) in pairs(result["rows"]).items()) + ".", "",
            f"Command: `PYTHONPATH=. python3 benchmarks/search_ordering.py {' '.join(result['argv'])}`"]
  return "\n".join(lines) + "\n"


def pairs(rows):
  """{(budget, batch): (sort row, pairwise row)} for the cells timed in both forms."""
  by = {(r["budget"], r["batch"], r["ordering"]): r for r in rows}
  return {(b, n): (by[b, n, "sort"], by[b, n, "pairwise"]) for b, n, o in by if o == "sort" and (b, n, "pairwise") in by}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  parser.add_argument("--cells", default=",".join(f"{b}x{n}" for b, n in CELLS),
                      help="budget x batch pairs, e.g. '16x1,16x8'")
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("search_ordering.py compares GPU step times (on the CPU both forms sort)")
  cells = [tuple(int(v) for v in cell.split("x")) for cell in args.cells.split(",")]
  rows = level_unroll.time_forms("RANK_SELECT_MAX", (("sort", 0), ("pairwise", policies.RANK_SELECT_MAX)), cells,
                                 key="ordering", new_tokens=128)
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv[1:], "rows": rows}
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "search_ordering.json").write_text(json.dumps(result, indent=1))
  (args.out / "search_ordering.md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  main()
