"""Acceptance and speed of the shipped demo pair: chain vs ddtree against autoregressive decoding.

    PYTHONPATH=. python3 benchmarks/bench_spec.py --out benchmarks/results   # on the GPU

Greedy (T = 0) on the held-out prompts shipped with the model (128 tokens each), 128 new tokens
per prompt. For each policy and budget: tau (mean accepted length per request per step, bonus
included), tokens/s at batch 1 and batch 16 and the speedup over autoregressive decoding timed in
the same run, the host share of step time, and experts touched per verify step. Every speculative
output is checked against the autoregressive one (near-tie rule, stated dtype). Writes
``bench_spec.json`` and ``bench_spec.md`` (and ``bench_spec.png`` with ``--plot``).
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

from ddtree_jax import drafters, engine
from ddtree_jax.near_tie import classify, greedy_reference
from models import dflash, loading


def tally(tokens, reference, dtype):
  """(near ties, real divergences, first few real ones) against the plain greedy reference."""
  verdicts = classify(tokens, *reference, dtype=dtype)
  ties = sum(1 for v in verdicts if v and v[0] == "tie")
  real = [(i, v[1], v[2]) for i, v in enumerate(verdicts) if v and v[0] == "divergence"]
  return ties, len(real), real[:5]


def run(args, out: Path):
  dtype = args.dtype
  target = loading.load_kimi(args.model, dtype=dtype, param_dtype=dtype)
  draft_model = loading.load_dflash(args.drafter, dtype=dtype, param_dtype=dtype)
  drafter = dflash.DFlashDrafter(draft_model.cfg)
  params = dflash.DFlashDrafter.params(draft_model, target)
  prompts_file = loading.resolve_model_dir(args.model) / "held_out_prompts.json"
  prompts = [p["tokens"] for p in json.loads(prompts_file.read_text())["prompts"]][:args.num_prompts]
  max_len = max(len(p) for p in prompts) + args.max_new_tokens + max(args.budgets) + 1
  buckets = (1, args.batch)
  common = dict(batch_buckets=buckets, max_len=max_len, num_slots=args.batch, show_progress=False)
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
             "dtype": dtype, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
             "batch_sizes": list(buckets), "argv": sys.argv[1:], "rows": []}

  def timed(dec, budget, batch_prompts, batch):
    """tokens, seconds of decode (prefill excluded), steps; batches of `batch` prompts."""
    tokens, seconds, steps = [], 0.0, []
    for i in range(0, len(batch_prompts), batch):
      r = dec.generate(batch_prompts[i:i + batch], args.max_new_tokens, budget=budget, stop_token_ids=[])
      tokens += r.tokens
      seconds += r.decode_time
      steps += r.steps
    return tokens, seconds, steps

  # Plain greedy decoding of the target alone (no engine): the reference every output is checked against.
  reference = greedy_reference(target, prompts, args.max_new_tokens, max_len)
  # Autoregressive baseline: the engine at budget 0 with no drafter work at all.
  t0 = time.perf_counter()
  ar = engine.SpeculativeDecoder(target, drafters.RandomDrafter(target.cfg.vocab_size), budgets=(0,), **common)
  compile_s = time.perf_counter() - t0
  timed(ar, 0, prompts[:args.batch], args.batch)  # warm the caches and allocator
  ref_tokens, ar_s16, _ = timed(ar, 0, prompts, args.batch)
  _, ar_s1, ar_steps = timed(ar, 0, prompts[:args.batch1_prompts], 1)
  ar_tps1 = args.batch1_prompts * args.max_new_tokens / ar_s1
  ar_tps16 = len(prompts) * args.max_new_tokens / ar_s16
  ties, real, _ = tally(ref_tokens, reference, dtype)
  results["autoregressive"] = {"tokens_per_s_batch1": ar_tps1, "tokens_per_s_batch16": ar_tps16,
                               "near_ties": ties, "divergences": real,
                               "compile_s": compile_s,
                               "host_share": float(np.mean([s.host_share for s in ar_steps]))}
  print(f"autoregressive: {ar_tps1:.0f} tok/s at batch 1, {ar_tps16:.0f} at batch {args.batch}", flush=True)

  for policy in args.policies:
    t0 = time.perf_counter()
    dec = engine.SpeculativeDecoder(target, drafter, params, policy=policy, budgets=args.budgets, **common)
    compile_s = time.perf_counter() - t0
    for budget in args.budgets:
      timed(dec, budget, prompts[:args.batch], args.batch)  # warm-up
      tokens16, s16, steps16 = timed(dec, budget, prompts, args.batch)
      _, s1, steps1 = timed(dec, budget, prompts[:args.batch1_prompts], 1)
      ties, real, examples = tally(tokens16, reference, dtype)
      accepted = [a for s in steps16 for a in s.accepted]
      row = {
          "policy": policy, "budget": budget, "tau": float(np.mean(accepted)),
          "tokens_per_s_batch1": args.batch1_prompts * args.max_new_tokens / s1,
          "tokens_per_s_batch16": len(prompts) * args.max_new_tokens / s16,
          "step_ms_batch1": 1e3 * float(np.median([s.step_time for s in steps1])),
          "host_share_batch1": float(np.mean([s.host_share for s in steps1])),
          "experts_touched_per_step_batch1": float(np.mean([s.experts_touched for s in steps1])),
          "experts_touched_per_step_batch16": float(np.mean([s.experts_touched for s in steps16])),
          "near_ties": ties, "divergences": real, "divergence_examples": examples,
          "compile_s_all_budgets": compile_s,
      }
      row["speedup_batch1"] = row["tokens_per_s_batch1"] / ar_tps1
      row["speedup_batch16"] = row["tokens_per_s_batch16"] / ar_tps16
      results["rows"].append(row)
      (out / "bench_spec.json").write_text(json.dumps(results, indent=1))  # partial results survive a timeout
      print(f"{policy:7s} budget {budget:3d}: tau {row['tau']:.2f}  batch1 {row['tokens_per_s_batch1']:.0f} tok/s "
            f"({row['speedup_batch1']:.2f}x)  batch{args.batch} {row['tokens_per_s_batch16']:.0f} tok/s "
            f"({row['speedup_batch16']:.2f}x)  near ties {ties}, divergences {real}", flush=True)
  return results


def markdown(results) -> str:
  ar = results["autoregressive"]
  lines = [f"# Demo pair: chain vs ddtree (greedy, {results['dtype']}, {results['device']})", "",
           f"{results['num_prompts']} held-out prompts x {results['max_new_tokens']} new tokens. "
           f"Autoregressive: {ar['tokens_per_s_batch1']:.0f} tok/s at batch 1, "
           f"{ar['tokens_per_s_batch16']:.0f} tok/s at batch {results['batch_sizes'][1]}.", "",
           "| policy | budget | tau | tok/s b1 | speedup b1 | tok/s b16 | speedup b16 | step ms b1 | host share b1 "
           "| experts/step b1 | near ties | divergences |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in results["rows"]:
    lines.append(f"| {r['policy']} | {r['budget']} | {r['tau']:.2f} | {r['tokens_per_s_batch1']:.0f} | "
                 f"{r['speedup_batch1']:.2f}x | {r['tokens_per_s_batch16']:.0f} | {r['speedup_batch16']:.2f}x | "
                 f"{r['step_ms_batch1']:.2f} | {r['host_share_batch1']:.2f} | "
                 f"{r['experts_touched_per_step_batch1']:.1f} | {r['near_ties']} | {r['divergences']} |")
  lines += ["", "Each output stream is compared with plain greedy decoding of the target alone; a stream may "
            f"differ only where the reference's top-2 logit margin is below the {results['dtype']} tolerance "
            "(near ties, counted); divergences are any other difference and must be 0.",
            f"Autoregressive engine vs the same reference: {ar.get('near_ties', '-')} near ties, "
            f"{ar.get('divergences', '-')} divergences.",
            "", f"Command: `PYTHONPATH=. python3 benchmarks/bench_spec.py {' '.join(results['argv'])}`"]
  return "\n".join(lines) + "\n"


def plot(results, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for policy in sorted({r["policy"] for r in results["rows"]}):
    rows = [r for r in results["rows"] if r["policy"] == policy]
    budgets = [r["budget"] for r in rows]
    axes[0].plot(budgets, [r["tau"] for r in rows], marker="o", label=policy)
    axes[1].plot(budgets, [r["speedup_batch1"] for r in rows], marker="o", label=f"{policy}, batch 1")
    axes[1].plot(budgets, [r["speedup_batch16"] for r in rows], marker="s", linestyle="--", label=f"{policy}, batch 16")
  for ax, title in zip(axes, ("acceptance length tau", "speedup over autoregressive")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tree nodes)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
  axes[1].axhline(1.0, color="gray", linewidth=0.8)
  fig.suptitle(f"kimi-demo + DFlash drafter, {results['device']}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="kimi-demo")
  parser.add_argument("--drafter", default="kimi-demo-dflash")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--policies", nargs="+", default=["chain", "ddtree"])
  parser.add_argument("--budgets", nargs="+", type=int, default=[4, 8, 16, 32, 64])
  parser.add_argument("--num-prompts", type=int, default=64)
  parser.add_argument("--batch1-prompts", type=int, default=16)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--plot", action="store_true", help="also write the PNG (pip install -e '.[bench]')")
  parser.add_argument("--replot", default=None, help="only redraw md/png from an existing JSON")
  args = parser.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = json.loads(Path(args.replot).read_text()) if args.replot else run(args, out)
  if not args.replot:
    (out / "bench_spec.json").write_text(json.dumps(results, indent=1))
  (out / "bench_spec.md").write_text(markdown(results))
  if args.plot or args.replot:
    plot(results, out / "bench_spec.png")
  print(markdown(results))


if __name__ == "__main__":
  main()
