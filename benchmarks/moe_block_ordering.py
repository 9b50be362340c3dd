"""The MoE block's row orderings by ``lax.sort`` against pairwise ranks on the GPU, side by side.

    PYTHONPATH=. python3 benchmarks/moe_block_ordering.py --out benchmarks/results     # GPU

``models.kimi.routed_block`` orders its M x K rows twice a layer: by expert (the sort before the
experts) and, on the GPU, each token's rows for the combine. ``models.ordering`` ranks sets of at
most ``kimi.MOE_ORDER_MAX_PAIRWISE`` rows by comparing every pair instead of ``lax.sort``. Two
tables, GPU time from CUPTI (16 calls in one executable, median of 5 runs, per call):

* ``ordering.stable_order`` of n int32 expert ids alone, sort (``max_pairwise=0``) against pairwise;
* the routed block with the Pallas experts at K2.6's widths (bf16, the 48-expert share, random top-8
  of 384 experts, T tokens), with ``MOE_ORDER_MAX_PAIRWISE`` = 0 against the default, and whether
  the two blocks' outputs are bit for bit the same.

Writes ``moe_block_ordering.{json,md}``.
"""

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import gpu_timing
from models import int4, kimi, ordering

CALLS = 16
SIZES = (72, 136, 544, 1088, 2048, 4096)
TOKENS = (9, 17, 65, 136)
ALL_EXPERTS, SHARE, TOP_K, HIDDEN, INTER = 384, 48, 8, 7168, 2048


def time_orders(rng) -> list[dict]:
  rows = []
  for n in SIZES:
    ids = jnp.asarray(rng.integers(0, SHARE + 1, (CALLS, n)).astype(np.int32))
    row = {"n": n}
    for form, max_pairwise in (("sort", 0), ("pairwise", n)):
      fn = jax.jit(lambda ids, m=max_pairwise: [ordering.stable_order(ids[c], max_pairwise=m) for c in range(CALLS)])
      row[f"{form}_us"], _ = gpu_timing.per_call_device_us(fn, (ids,), CALLS)
      row[f"{form}_out"] = np.asarray(fn(ids)[0])
    row["same"] = bool((row.pop("sort_out") == row.pop("pairwise_out")).all())
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def time_blocks(rng) -> list[dict]:
  key = jax.random.key(0)
  shapes = ((SHARE, HIDDEN, INTER), (SHARE, HIDDEN, INTER), (SHARE, INTER, HIDDEN))
  experts = int4.Bf16Experts(*(0.02 * jax.random.normal(k, s, jnp.bfloat16)
                               for k, s in zip(jax.random.split(key, 3), shapes)))
  chosen, rows = kimi.MOE_ORDER_MAX_PAIRWISE, []
  try:
    for t in TOKENS:
      tokens = jnp.asarray(rng.standard_normal((CALLS, t, HIDDEN)), jnp.bfloat16)
      ids = jnp.asarray(np.stack([[rng.permutation(ALL_EXPERTS)[:TOP_K] for _ in range(t)] for _ in range(CALLS)]),
                        jnp.int32)
      weights = jnp.asarray(rng.random((CALLS, t, TOP_K)), jnp.float32)
      row = {"tokens": t, "rows": t * TOP_K}
      outs = {}
      for form, max_pairwise in (("sort", 0), ("pairwise", chosen)):
        kimi.MOE_ORDER_MAX_PAIRWISE = max_pairwise
        # The weights are an argument: closed over, 4.2 GB of constants would go into the program.
        fn = jax.jit(lambda x, i, w, ex: [kimi.routed_block(x[c], i[c], w[c], ex, "pallas")[0] for c in range(CALLS)])
        fn = fn.lower(tokens, ids, weights, experts).compile()  # traced with this form's setting
        row[f"{form}_us"], kinds = gpu_timing.per_call_device_us(fn, (tokens, ids, weights, experts), CALLS)
        row[f"{form}_sort_us"] = sum(us for kind, us in kinds.items() if "sort" in kind.lower())
        outs[form] = np.asarray(fn(tokens, ids, weights, experts)[0], np.float32)
      row["same"] = bool((outs["sort"] == outs["pairwise"]).all())
      rows.append(row)
      print(json.dumps(row), flush=True)
  finally:
    kimi.MOE_ORDER_MAX_PAIRWISE = chosen
  return rows


def markdown(result: dict) -> str:
  lines = [f"# The MoE block's row orderings: lax.sort against pairwise ranks ({result['device']}, jax {result['jax']})",
           "", f"GPU us per call (CUPTI, {CALLS} calls in one executable, median of 5 runs).", "",
           "`ordering.stable_order` of n int32 ids (expert ids of the 48-expert share):", "",
           "| n | sort us | pairwise us | pairwise / sort | same order |", "| --- | --- | --- | --- | --- |"]
  for r in result["orders"]:
    lines.append(f"| {r['n']} | {r['sort_us']:.1f} | {r['pairwise_us']:.1f} | {r['pairwise_us'] / r['sort_us']:.2f}x | "
                 f"{'yes' if r['same'] else 'NO'} |")
  lines += ["", f"`kimi.routed_block` (Pallas experts, bf16, {SHARE}-expert share of {ALL_EXPERTS}, top-{TOP_K}, "
            f"K2.6's widths), `MOE_ORDER_MAX_PAIRWISE` = 0 (sort) against {result['max_pairwise']}:", "",
            "| T | rows | sort us | of it sort kernels | pairwise us | pairwise / sort | same output |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["blocks"]:
    lines.append(f"| {r['tokens']} | {r['rows']} | {r['sort_us']:.1f} | {r['sort_sort_us']:.1f} | {r['pairwise_us']:.1f} | "
                 f"{r['pairwise_us'] / r['sort_us']:.2f}x | {'yes' if r['same'] else 'NO'} |")
  lines += ["", f"Command: `PYTHONPATH=. python3 benchmarks/moe_block_ordering.py {' '.join(result['argv'])}`"]
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("moe_block_ordering.py times GPU kernels (on the CPU both forms sort)")
  rng = np.random.default_rng(0)
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv[1:],
            "max_pairwise": kimi.MOE_ORDER_MAX_PAIRWISE, "orders": time_orders(rng), "blocks": time_blocks(rng)}
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "moe_block_ordering.json").write_text(json.dumps(result, indent=1))
  (args.out / "moe_block_ordering.md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  main()
