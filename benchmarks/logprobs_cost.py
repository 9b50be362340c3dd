"""What computing log-probabilities costs a decode step (``SpeculativeDecoder(logprobs=n)``).

    PYTHONPATH=. python3 benchmarks/logprobs_cost.py --out benchmarks/results     # GPU (CPU: batch 1 only)

1. The demo pair (bf16, greedy, budget 16, held-out prompts) with logprobs off, 0 (each token's own
   only), 5 (the server's default ``--max-logprobs``) and 20: tokens/s of one ``generate`` of 128
   new tokens, the raw step (dispatched without reading), on the GPU the busy time per step from a
   trace; whether the tokens equal those with logprobs off. Batch 1 and 16.
2. ``logprobs.token_logprobs`` alone at Kimi K2.6's vocabulary (163840), float32 logits, at the
   rows a K2.6 verify step has (batch x tree nodes): its GPU time (CUPTI) for n = 0, 5 and 20.

Writes ``logprobs_cost.{json,md}``.
"""

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import level_unroll
from ddtree_jax import engine
from ddtree_jax import logprobs as logprobs_lib
from models import dflash, loading

SETTINGS = (None, 0, 5, 20)
K2_VOCAB = 163840
# (batch, tree nodes): the server's budget table 1:32,4:16,16:8,64:4 at its largest batches.
K2_SHAPES = ((1, 33), (4, 17), (16, 9), (64, 5))


def engine_rows(gpu: bool) -> list:
  target = loading.load_kimi("kimi-demo", dtype="bfloat16")
  draft = loading.load_dflash("kimi-demo-dflash", dtype="bfloat16")
  held = json.loads((loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json").read_text())["prompts"]
  rows, baseline = [], {}
  for bucket in ((1, 16) if gpu else (1,)):
    prompts = [held[i % len(held)]["tokens"] for i in range(bucket)]
    for setting in SETTINGS:
      t0 = time.perf_counter()
      decoder = engine.SpeculativeDecoder(target, dflash.DFlashDrafter(draft.cfg),
                                          dflash.DFlashDrafter.params(draft, target), policy="ddtree",
                                          budgets=(level_unroll.BUDGET,), batch_buckets=(bucket,), max_len=1024,
                                          logprobs=setting, show_progress=False)
      row = {"logprobs": setting, "batch": bucket, "compile_s": time.perf_counter() - t0,
             **level_unroll.measure(decoder, prompts, bucket, 128 if gpu else 16)}
      tokens = row.pop("tokens")
      baseline.setdefault(bucket, tokens)
      row["same_tokens"] = tokens == baseline[bucket]
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def k2_rows() -> list:
  from gpu_timing import per_call_device_us  # pylint: disable=import-outside-toplevel  # CUPTI: GPU only
  rng = np.random.default_rng(0)
  rows = []
  for batch, nodes in K2_SHAPES:
    logits = jnp.asarray(rng.normal(0, 4, (batch, nodes, K2_VOCAB)), jnp.float32)
    path = jnp.asarray(np.sort(rng.integers(0, nodes, (batch, nodes)), axis=1), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, K2_VOCAB, (batch, nodes)), jnp.int32)
    for top_n in SETTINGS[1:]:
      fn = jax.jit(lambda z, p, t, n=top_n: logprobs_lib.token_logprobs(z, p, t, n))
      us, kinds = per_call_device_us(fn, (logits, path, tokens), calls=1)
      rows.append({"batch": batch, "nodes": nodes, "top_n": top_n, "gpu_us": us, "kernels": kinds})
      print(json.dumps(rows[-1]), flush=True)
  return rows


def markdown(result: dict) -> str:
  label = lambda s: "off" if s is None else str(s)
  lines = [f"# What log-probabilities cost a step ({result['device']}, jax {result['jax']})", "",
           f"Demo pair, bf16, greedy, budget {level_unroll.BUDGET}; raw: {level_unroll.RAW_STEPS} steps dispatched "
           "without reading them; busy: the GPU's busy time per step from a trace of "
           f"{level_unroll.TRACE_STEPS} engine steps. *vs off*: raw step against logprobs off in the same batch.", "",
           "| logprobs | batch | compile s | tok/s | raw step ms | vs off | busy us | tokens as with logprobs off |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  off = {r["batch"]: r["raw_step_ms"] for r in result["engine"] if r["logprobs"] is None}
  for r in result["engine"]:
    busy = format(r["busy_us_per_step"], ".0f") if "busy_us_per_step" in r else "-"
    lines.append(f"| {label(r['logprobs'])} | {r['batch']} | {r['compile_s']:.1f} | {r['tokens_per_s']:.0f} | "
                 f"{r['raw_step_ms']:.3f} | {r['raw_step_ms'] / off[r['batch']]:.3f}x | {busy} | "
                 f"{'yes' if r['same_tokens'] else 'NO'} |")
  if result["k2"]:
    lines += ["", f"`token_logprobs` alone at K2.6's vocabulary ({K2_VOCAB}), float32 logits, GPU us (CUPTI, median "
              "of 5): *nodes* is the tree's rows per request, all of them emitting (the most top-n work a step has).", "",
              "| batch | nodes | n = 0 | n = 5 | n = 20 |", "| --- | --- | --- | --- | --- |"]
    by_shape = {}
    for r in result["k2"]:
      by_shape.setdefault((r["batch"], r["nodes"]), {})[r["top_n"]] = r["gpu_us"]
    for (batch, nodes), times in by_shape.items():
      lines.append(f"| {batch} | {nodes} | " + " | ".join(f"{times[n]:.1f}" for n in SETTINGS[1:]) + " |")
  lines += ["", f"Command: `PYTHONPATH=. python3 benchmarks/logprobs_cost.py {' '.join(result['argv'])}`"]
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()
  gpu = jax.default_backend() == "gpu"
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv[1:], "engine": [],
            "k2": []}
  args.out.mkdir(parents=True, exist_ok=True)
  # CUPTI first: on 2026-12-07 measuring with it after the engine part's profiler traces aborted the
  # process ("activity records were dropped"), losing the whole run. Results are written after each part.
  for part, rows in (("k2", k2_rows if gpu else list), ("engine", lambda: engine_rows(gpu))):
    result[part] = rows()
    (args.out / "logprobs_cost.json").write_text(json.dumps(result, indent=1))
  (args.out / "logprobs_cost.md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  main()
