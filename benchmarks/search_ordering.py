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
import time

import jax

import level_unroll
from ddtree_jax import engine, policies
from models import dflash, loading

CELLS = ((16, 1), (16, 8), (32, 1), (8, 8))  # (budget, batch): the server's default table's pairs


def markdown(result: dict) -> str:
  lines = [f"# The DDTree policy's orderings: lax.sort against pairwise ranks ({result['device']}, jax {result['jax']})",
           "", f"Demo pair, bf16, greedy; raw: {level_unroll.RAW_STEPS} steps dispatched without reading them; "
           f"kernels, copies and busy time per step from a trace of {level_unroll.TRACE_STEPS} engine steps.", "",
           "| budget | batch | ordering | compile s | tok/s | raw step ms | kernels | copies | busy us | tokens as sorted |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    per_step = lambda key, fmt: format(row[key], fmt) if key in row else "-"
    lines.append(f"| {row['budget']} | {row['batch']} | {row['ordering']} | {row['compile_s']:.1f} | "
                 f"{row['tokens_per_s']:.0f} | {row['raw_step_ms']:.3f} | {per_step('kernels_per_step', '.0f')} | "
                 f"{per_step('copies_per_step', '.0f')} | {per_step('busy_us_per_step', '.0f')} | "
                 f"{'yes' if row['same_tokens'] else 'NO'} |")
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
  target = loading.load_kimi("kimi-demo", dtype="bfloat16")
  draft = loading.load_dflash("kimi-demo-dflash", dtype="bfloat16")
  held = json.loads((loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json").read_text())["prompts"]
  rows, sorted_tokens = [], {}
  chosen = policies.RANK_SELECT_MAX
  try:
    for budget, bucket in cells:
      for ordering in ("sort", "pairwise"):
        policies.RANK_SELECT_MAX = 0 if ordering == "sort" else chosen
        prompts = [held[i % len(held)]["tokens"] for i in range(bucket)]
        t0 = time.perf_counter()
        decoder = engine.SpeculativeDecoder(target, dflash.DFlashDrafter(draft.cfg),
                                            dflash.DFlashDrafter.params(draft, target), policy="ddtree",
                                            budgets=(budget,), batch_buckets=(bucket,), max_len=1024,
                                            show_progress=False)
        row = {"budget": budget, "batch": bucket, "ordering": ordering, "compile_s": time.perf_counter() - t0,
               **level_unroll.measure(decoder, prompts, bucket, 128, budget=budget)}
        tokens = row.pop("tokens")
        sorted_tokens.setdefault((budget, bucket), tokens)
        row["same_tokens"] = tokens == sorted_tokens[budget, bucket]
        rows.append(row)
        print(json.dumps(row), flush=True)
  finally:
    policies.RANK_SELECT_MAX = chosen
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv[1:], "rows": rows}
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "search_ordering.json").write_text(json.dumps(result, indent=1))
  (args.out / "search_ordering.md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  main()
