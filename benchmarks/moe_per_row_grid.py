"""Per-pair items at one token on a compact grid (H200): the 48-expert share's dead pairs.

    PYTHONPATH=. python3 benchmarks/moe_per_row_grid.py --out benchmarks/results   # on the GPU

At one token the model's routed block runs ``moe.moe_experts_per_row`` on the token's 8 (token,
expert) pairs. Under 8-way expert parallelism a GPU holds 48 of the 384 experts, so on average 1
of the 8 pairs is live (a third of the steps none) and the other 7 launch programs that only
exit: 7 x 32 gate/up and 7 x 112 down programs. With ``item_programs`` G below 8 the kernels run
G programs along the pairs, which find the live pairs in their prologue and take them first
(more live pairs than G run in a second round). This times, for ``bench_moe.py``'s routings at
T = 1 on shares of ``--experts`` (16 steps in one executable, GPU time from CUPTI, every variant of
a cell in turn, ``--repeats`` times), G = 8 (a program per pair) against smaller grids
(``--grids``), in bf16 and INT4, with the fraction of the touched experts' read roofline and
whether the rows equal G = 8's bit for bit; it marks the grid that ``moe.default_pair_programs``
picks for the share's expected rows. Writes ``moe_per_row_grid.json`` and ``.md`` (``--name``).
"""

import sys
import time

import jax
import numpy as np

import bench_moe as bench
import moe_share
import results_io
from pallas_kernels import moe

EXPERTS = (48, 96)
GRIDS = (8, 4, 3, 2, 1)
REPEATS = 5
PAIRS = 8  # bench_moe.TOP_K pairs of one token


def layer(item_programs, expected_rows):
  def call(tokens, ids, w):
    return moe.moe_experts_per_row(tokens, ids, w, expected_rows=expected_rows, item_programs=item_programs)
  return call


def cell(row: dict) -> tuple:
  return (row["experts"], row["format"], -row["item_programs"])


def markdown(result: dict) -> str:
  lines = [f"# Per-pair items at one token on a compact grid ({result['device']}, jax {result['jax']})", "",
           "An expert-parallel share of E experts at T = 1, `bench_moe.py`'s routings (*live*: the token's "
           f"pairs routed to the share, of {PAIRS}, on average). GPU us per layer call (CUPTI; 16 steps in one "
           f"executable; the median of {result['repeats']} timings, the variants of a cell in turn), the "
           "fraction of the touched experts' read roofline (stream measured in the same run), the kernels' "
           "shares, the time against a program per pair's, and whether all 16 steps' rows equal it bit for "
           f"bit. *G*: programs along the pairs ({PAIRS}: one per pair); *default*: `moe.default_pair_programs` "
           "for the share's expected rows.", "",
           "| E | live | format | G | GPU us | of roofline | kernels | vs G = 8 | rows |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    grid = f"**{row['item_programs']}** (default)" if row["default"] else str(row["item_programs"])
    lines.append(f"| {row['experts']} | {row['touched']:.2f} | {row['format']} | {grid} | {row['gpu_us']:.1f} | "
                 f"{row['roofline_fraction']:.1%} | {results_io.kernel_shares(row['kernels'])} | "
                 f"{row['vs_default']:.3f}x | {row['rows']} |")
  return results_io.with_command(lines, result)


def main():
  parser = results_io.results_parser(__doc__, "moe_per_row_grid")
  parser.add_argument("--formats", nargs="+", default=["bf16", "int4"], choices=["bf16", "int4"])
  parser.add_argument("--experts", nargs="+", type=int, default=list(EXPERTS), help="the share's experts (of 384)")
  parser.add_argument("--grids", nargs="+", type=int, default=list(GRIDS), help=f"G values ({PAIRS}: one per pair)")
  parser.add_argument("--repeats", type=int, default=REPEATS)
  args = parser.parse_args()
  if PAIRS not in args.grids or any(not 1 <= g <= PAIRS for g in args.grids):
    parser.error(f"--grids must be in [1, {PAIRS}] and include {PAIRS} (the baseline)")
  results_io.check_positive(parser, repeats=args.repeats, experts=min(args.experts))
  results_io.require_gpu("moe_per_row_grid.py")
  start = time.perf_counter()
  stream = bench.ceilings()["stream_read_bytes_per_s"]
  rows = []
  for experts in args.experts:
    cell_ = moe_share.pair_cell(experts)
    default = moe.default_pair_programs(PAIRS, cell_.expected_rows) or PAIRS
    for fmt in args.formats:
      w = (bench.make_bf16 if fmt == "bf16" else bench.make_int4)(jax.random.key(experts + 1), experts)
      roofline_us = bench.weight_bytes(fmt, cell_.touched) / stream * 1e6
      timed = moe_share.time_variants({g: layer(g, cell_.expected_rows) for g in args.grids}, cell_, w, args.repeats)
      for g, t in timed.items():
        same = np.array_equal(t.rows, timed[PAIRS].rows)
        rows.append(dict(experts=experts, tokens=1, touched=cell_.touched, format=fmt, item_programs=g,
                         default=g == default, gpu_us=t.gpu_us, roofline_us=roofline_us,
                         roofline_fraction=roofline_us / t.gpu_us, kernels=t.kernels,
                         vs_default=t.gpu_us / timed[PAIRS].gpu_us, rows="bit-identical" if same else "DIFFER"))
        print(f"E={experts} {fmt} G={g}: {t.gpu_us:.1f} us ({roofline_us / t.gpu_us:.1%}) {rows[-1]['rows']}",
              flush=True)
      del w
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=False, cell=cell, repeats=args.repeats)


if __name__ == "__main__":
  main()
