"""The DDTree policy's level scan looped against unrolled, in one process: the demo pair's budget-16 step.

    PYTHONPATH=. python3 benchmarks/level_unroll.py --out benchmarks/results     # GPU (CPU: no trace)

``policies._layered_search`` scans the drafter's positions (15 for the demo drafter). For
``policies.LEVEL_SCAN_UNROLL`` = 1 (a ``while`` loop) and True (unrolled), at batch 1 and 8 (bf16,
greedy, held-out prompts): the decoder's compile time, tokens/s of one ``generate`` of 128 new
tokens (16 on the CPU) after a warm-up, the raw step (40 dispatched without reading them), and on
the GPU the kernels, copies and busy time per step from a trace of 8 engine steps; and whether the
two forms' tokens are identical (each batch's two forms now one after the other). Writes
``level_unroll.{json,md}``. ``time_forms`` runs such a comparison for any ``policies`` setting
(``search_ordering.py`` uses it).
"""

import argparse
import json
import pathlib
import sys
import time

import jax

import step_overhead
from ddtree_jax import engine, policies
from models import dflash, loading

BUDGET = 16
RAW_STEPS = 40
TRACE_STEPS = 8


def measure(decoder, prompts, bucket: int, new_tokens: int, budget: int = BUDGET) -> dict:
  decoder.generate(prompts, 16, budget=budget, stop_token_ids=[])  # warm
  t0 = time.perf_counter()
  result = decoder.generate(prompts, new_tokens, budget=budget, stop_token_ids=[])
  row = {"tokens_per_s": sum(map(len, result.tokens)) / (time.perf_counter() - t0), "tokens": result.tokens}
  batch = engine.Batch(decoder, bucket)
  for prompt in prompts:
    batch.admit(decoder.request(prompt, 800, stop_token_ids=[]))
  batch.collect(batch.dispatch(budget))
  t0 = time.perf_counter()
  for _ in range(RAW_STEPS):
    handle = batch.dispatch(budget)
  jax.block_until_ready(handle[1])
  row["raw_step_ms"] = 1e3 * (time.perf_counter() - t0) / RAW_STEPS
  if jax.default_backend() == "gpu":
    row.update(step_overhead.summarize(step_overhead.trace_engine_steps(batch, budget, TRACE_STEPS), TRACE_STEPS))
  batch.close()
  return row


def step_cells(row: dict) -> str:
  """A ``measure``d row's table cells: compile s | tok/s | raw step ms | kernels | copies | busy us |
  same tokens ("-" where the GPU-only columns are missing)."""
  per_step = lambda key, fmt: format(row[key], fmt) if key in row else "-"
  return (f"{row['compile_s']:.1f} | {row['tokens_per_s']:.0f} | {row['raw_step_ms']:.3f} | "
          f"{per_step('kernels_per_step', '.0f')} | {per_step('copies_per_step', '.0f')} | "
          f"{per_step('busy_us_per_step', '.0f')} | {'yes' if row['same_tokens'] else 'NO'}")


def markdown(result: dict) -> str:
  lines = [f"# The DDTree policy's level scan, looped against unrolled ({result['device']}, jax {result['jax']})", "",
           f"Demo pair, bf16, greedy, budget {BUDGET}; raw: {RAW_STEPS} steps dispatched without reading them; "
           f"kernels, copies and busy time per step from a trace of {TRACE_STEPS} engine steps (GPU only).", "",
           "| scan | batch | compile s | tok/s | raw step ms | kernels | copies | busy us | tokens as looped |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    lines.append(f"| {row['scan']} | {row['batch']} | {step_cells(row)} |")
  lines += ["", f"Command: `PYTHONPATH=. python3 benchmarks/level_unroll.py {' '.join(result['argv'])}`"]
  return "\n".join(lines) + "\n"


def time_forms(setting: str, forms, cells, *, key: str, new_tokens: int) -> list[dict]:
  """Demo-pair decoders (ddtree, bf16) under each form of a ``policies`` setting, in one process.

  For each (budget, batch) of ``cells`` and each (label, value) of ``forms`` in turn, with
  ``policies.<setting>`` = value (restored afterwards): a decoder compiled for that one shape and
  ``measure``d, as a row {key: label, "budget", "batch", "compile_s", ..., "same_tokens"} (its
  tokens against the cell's first form's).
  """
  target = loading.load_kimi("kimi-demo", dtype="bfloat16")
  draft = loading.load_dflash("kimi-demo-dflash", dtype="bfloat16")
  held = json.loads((loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json").read_text())["prompts"]
  rows, first_tokens = [], {}
  chosen = getattr(policies, setting)
  try:
    for budget, bucket in cells:
      for label, value in forms:
        setattr(policies, setting, value)
        prompts = [held[i % len(held)]["tokens"] for i in range(bucket)]
        t0 = time.perf_counter()
        decoder = engine.SpeculativeDecoder(target, dflash.DFlashDrafter(draft.cfg),
                                            dflash.DFlashDrafter.params(draft, target), policy="ddtree",
                                            budgets=(budget,), batch_buckets=(bucket,), max_len=1024,
                                            show_progress=False)
        row = {key: label, "budget": budget, "batch": bucket, "compile_s": time.perf_counter() - t0,
               **measure(decoder, prompts, bucket, new_tokens, budget=budget)}
        tokens = row.pop("tokens")
        first_tokens.setdefault((budget, bucket), tokens)
        row["same_tokens"] = tokens == first_tokens[budget, bucket]
        rows.append(row)
        print(json.dumps(row), flush=True)
  finally:
    setattr(policies, setting, chosen)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()
  gpu = jax.default_backend() == "gpu"
  rows = time_forms("LEVEL_SCAN_UNROLL", (("looped", 1), ("unrolled", True)),
                    [(BUDGET, bucket) for bucket in ((1, 8) if gpu else (1,))], key="scan",
                    new_tokens=128 if gpu else 16)
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv[1:], "rows": rows}
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "level_unroll.json").write_text(json.dumps(result, indent=1))
  (args.out / "level_unroll.md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  main()
