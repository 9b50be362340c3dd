"""bf16 MoE rows per work item at prefill sizes: 64 against 128, or any set (H200).

    PYTHONPATH=. python3 benchmarks/moe_prefill_rows.py --out benchmarks/results   # on the GPU

Each work item of the MoE kernel reads its expert's weights once, so where an expert's rows do not
fit one item (``moe.default_block_rows``: the expected rows an expert plus an 8-aligned window's
offset) its weights are read twice. At prefill sizes that sets a layer's time: one K2.6 layer at
T = 4096 routes ~85 rows to each expert, past 64. This times one layer (gate, up, down) as the
model calls it (``moe_experts`` with the sorted rows' expert ids and ``expected_rows``), for 384
experts and the 48-expert share, at T where an expert expects 53 to 171 rows, with:

* ``64 rows``: ``block_rows=64`` (the cap before 128-row items) and its tiles, ``BF16_TILES``;
* ``128 rows, BF16_TILES``: 128-row items with the same tiles (the down kernel then keeps three
  of its four stages, and one program an SM);
* ``default``: what the kernel picks (``default_block_rows``, ``default_tiles``: 128-row items take
  ``BF16_WIDE_ITEM_TILES``);

or, with ``--rows R ...``, ``R rows`` for each R (``block_rows=R``, default tiles), to check the rule
at other T.

Routings as ``bench_moe.py`` draws them (random top-8 over 384 experts, the share keeping its
experts' rows, the rest padding), ``--routings`` of them as the calls of one executable, GPU time
from CUPTI, the variants of a cell in turn ``--repeats`` times. Each row: GPU us per layer call,
the fraction of the touched experts' weight-read roofline (a stream measured in the same run), the
kernels' times in the last timing, the time against the cell's first variant, and whether every
routed row equals the first variant's bit for bit. Writes ``moe_prefill_rows.json`` and ``.md`` (``--name``).
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_moe as bench
import results_io
from pallas_kernels import moe

EXPERTS = (384, 48)
TOKENS = (2560, 3072, 4096, 8192)
ROUTINGS = 4
REPEATS = 3


def variants(rows=None) -> dict:
  """name -> ``moe_experts`` keyword arguments: the three above, or ``R rows`` for each R of ``rows``."""
  if rows:
    return {f"{r} rows": dict(block_rows=r) for r in rows}
  return {"64 rows": dict(block_rows=64), "128 rows, BF16_TILES": dict(block_rows=128, tiles=moe.BF16_TILES),
          "default": {}}


def layer(expected_rows: int, **options):
  return lambda x, g, w: moe.moe_experts(x, g[0], w, expected_rows=expected_rows, sorted_expert_ids=g[1], **options)


def calls(tokens: int, experts: int, routings: int, seed: int) -> list:
  """[(x_sorted bf16 [8T, H], (group_sizes int32[E], sorted rows' experts int32[8T]))]: top-8 of
  384 experts per token, the rows of experts past ``experts`` sorted last as padding (id E); x
  drawn on the device (at T = 8192 a routing's rows are 0.9 GB)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(routings):
    ids = np.argsort(-rng.random((tokens, bench.ALL_EXPERTS)), axis=1)[:, :bench.TOP_K].reshape(-1)
    local = np.sort(np.where(ids < experts, ids, experts))
    sizes = np.bincount(local, minlength=experts + 1)[:experts].astype(np.int32)
    x = jax.random.normal(jax.random.key(seed * 100 + i), (ids.size, bench.HIDDEN), jnp.bfloat16)
    out.append((x, (jnp.asarray(sizes), jnp.asarray(local.astype(np.int32)))))
  return out


def cell(row: dict) -> tuple:
  return (row["experts"], row["tokens"], row["block_rows"], row["variant"])


def markdown(result: dict) -> str:
  lines = [f"# bf16 MoE rows per work item at prefill sizes ({result['device']}, jax {result['jax']})",
           "", "One K2.6 layer (gate, up, down) as the model calls it (sorted rows' expert ids given), bf16, "
           f"{result['routings']} routings as the calls of one executable. GPU us per layer call (CUPTI; the median of "
           f"{result['repeats']} timings, the variants of a cell in turn), the fraction of the touched experts' "
           "weight-read roofline (stream measured in the same run), the kernels' times in the last timing, the "
           "time against the cell's first variant, and whether every routed row equals the first variant's bit "
           "for bit. R: rows per work item.", "",
           "| E | T | rows an expert | variant | R | GPU us | of roofline | kernels | vs first | same rows |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    lines.append(f"| {row['experts']} | {row['tokens']} | {row['rows_per_expert']:.0f} | {row['variant']} | "
                 f"{row['block_rows']} | {row['gpu_us']:.0f} | {row['roofline_fraction']:.1%} | "
                 f"{results_io.kernel_shares(row['kernels'])} | {row['vs_first']:.3f}x | "
                 f"{'yes' if row['same_rows'] else '**no**'} |")
  return results_io.with_command(lines, result)


def time_cell(experts: int, tokens: int, stream: float, routings: int, repeats: int, w, rows=None) -> list:
  cell_calls = calls(tokens, experts, routings, seed=1000 * experts + tokens)
  xs, gs = [c[0] for c in cell_calls], [c[1] for c in cell_calls]
  expected = bench.expected_rows(xs[0], gs[0][0])
  routed = [int(np.asarray(g[0]).sum()) for g in gs]
  touched = float(np.mean([int((np.asarray(g[0]) > 0).sum()) for g in gs]))
  roofline_us = bench.weight_bytes("bf16", touched) / stream * 1e6
  named = variants(rows)
  steps = {name: bench.in_step(layer(expected, **options)) for name, options in named.items()}
  first = None
  same = {}
  for name, step in steps.items():  # the rows, compared on the device: each call's output is 0.9 GB at T = 8192
    out = step(xs, gs, w)
    if first is None:
      first = out
    same[name] = all(bool(jnp.array_equal(a[:n], b[:n])) for a, b, n in zip(out, first, routed))
    del out
  del first
  timings = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      timings[name].append(bench.device_in_step(step, cell_calls, w))
  out = []
  base = None
  for name, options in named.items():
    gpu_us = statistics.median(us for us, _ in timings[name])
    base = base or gpu_us
    block_rows = options.get("block_rows") or moe.default_block_rows(experts, expected, is_int4=False)
    kernels = {k: us for k, us in timings[name][-1][1].items() if "mosaic_gpu" in k}
    out.append(dict(experts=experts, tokens=tokens, rows_per_expert=expected / experts, variant=name,
                     block_rows=block_rows, touched=touched, gpu_us=gpu_us, roofline_us=roofline_us,
                     roofline_fraction=roofline_us / gpu_us, kernels=kernels, vs_first=gpu_us / base,
                     same_rows=same[name]))
    print(f"E={experts} T={tokens} {name} (R={block_rows}): {gpu_us:.0f} us ({roofline_us / gpu_us:.1%}), "
          f"{gpu_us / base:.3f}x, same rows {same[name]}", flush=True)
  return out


def main():
  parser = results_io.results_parser(__doc__, "moe_prefill_rows")
  parser.add_argument("--experts", type=int, nargs="+", default=list(EXPERTS))
  parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
  parser.add_argument("--routings", type=int, default=ROUTINGS)
  parser.add_argument("--repeats", type=int, default=REPEATS)
  parser.add_argument("--rows", type=int, nargs="*", default=[],
                      help="time R rows per item for each R instead of the three variants")
  args = parser.parse_args()
  results_io.check_positive(parser, routings=args.routings, repeats=args.repeats)
  for e in args.experts:
    if not 1 <= e <= bench.ALL_EXPERTS:
      parser.error(f"--experts: {e} is not in [1, {bench.ALL_EXPERTS}] (a share of K2.6's experts)")
  for t in args.tokens:
    if t < 1:
      parser.error(f"--tokens: {t} must be >= 1")
  for r in args.rows:
    if r % moe.MIN_BLOCK_ROWS or not moe.MIN_BLOCK_ROWS <= r <= moe.MAX_BLOCK_ROWS["bf16"]:
      parser.error(f"--rows: {r} is not a multiple of {moe.MIN_BLOCK_ROWS} in [16, 128]")
  results_io.require_gpu("moe_prefill_rows.py")
  start = time.perf_counter()
  stream = bench.ceilings()["stream_read_bytes_per_s"]
  rows = []
  for experts in args.experts:
    w = bench.make_bf16(jax.random.key(experts), experts)
    for tokens in args.tokens:
      rows += time_cell(experts, tokens, stream, args.routings, args.repeats, w, args.rows)
    del w
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=False, cell=cell, repeats=args.repeats, routings=args.routings)


if __name__ == "__main__":
  main()
