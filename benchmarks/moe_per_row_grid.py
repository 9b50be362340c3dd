"""Per-pair items at one token on a compact grid (H200): the 48-expert share's dead pairs.

    PYTHONPATH=. python3 benchmarks/moe_per_row_grid.py --out benchmarks/results   # on the GPU

At one token the model's routed block runs ``moe.moe_experts_per_row`` on the token's 8 (token,
expert) pairs. Under 8-way expert parallelism a GPU holds 48 of the 384 experts, so on average 1
of the 8 pairs is live (a third of the steps none) and the other 7 launch programs that only
exit: 7 x 32 gate/up and 7 x 112 down programs. With ``item_programs`` G below 8 the kernels run
G programs along the pairs, which find the live pairs in their prologue and take them first
(more live pairs than G run in a second round). This times, for ``bench_moe.py``'s routings at
T = 1 (16 steps in one executable, GPU time from CUPTI, every variant of a cell in turn,
``REPEATS`` times), G = 8 (a program per pair: the default) against smaller grids, in bf16 and
INT4, with the fraction of the touched experts' read roofline and whether the rows equal the
default's bit for bit. Writes ``moe_per_row_grid.json`` and ``.md`` (``--name``).
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

EXPERTS = 48
GRIDS = (None, 4, 3, 2)  # None: a program per pair
REPEATS = 3


def layer(item_programs):
  def call(tokens, ids, w):
    return moe.moe_experts_per_row(tokens, ids, w, expected_rows=1, item_programs=item_programs)
  return call


def cell(row: dict) -> tuple:
  return (row["format"], -1 if row["item_programs"] is None else -row["item_programs"])


def markdown(result: dict) -> str:
  lines = [f"# Per-pair items at one token on a compact grid ({result['device']}, jax {result['jax']})", "",
           f"The 48-expert share at T = 1, `bench_moe.py`'s routings ({result['rows'][0]['touched']:.2f} live pairs "
           "of 8 a "
           f"step on average). GPU us per layer call (CUPTI; 16 steps in one executable; the median of {REPEATS} "
           "timings, the variants of a format in turn), the fraction of the touched experts' read roofline "
           "(stream measured in the same run), the kernels' shares, the time against a program per pair's, and "
           "whether all 16 steps' rows equal it bit for bit. *G*: programs along the pairs (8: one per pair, "
           "the default).", "",
           "| format | G | GPU us | of roofline | kernels | vs G = 8 | rows |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    grid = 8 if row["item_programs"] is None else row["item_programs"]
    lines.append(f"| {row['format']} | {grid} | {row['gpu_us']:.1f} | {row['roofline_fraction']:.1%} | "
                 f"{results_io.kernel_shares(row['kernels'])} | {row['vs_default']:.3f}x | {row['rows']} |")
  return results_io.with_command(lines, result)


def main():
  parser = results_io.results_parser(__doc__, "moe_per_row_grid")
  parser.add_argument("--formats", nargs="+", default=["bf16", "int4"], choices=["bf16", "int4"])
  args = parser.parse_args()
  results_io.require_gpu("moe_per_row_grid.py")
  start = time.perf_counter()
  stream = bench.ceilings()["stream_read_bytes_per_s"]
  routings = bench.routings(1, EXPERTS, seed=1000 * EXPERTS + 1)
  rng = np.random.default_rng(EXPERTS)
  # The token's 8 pairs: ids of experts held elsewhere are E (routed nowhere here).
  calls = [(jnp.asarray(rng.standard_normal((1, bench.HIDDEN)), jnp.bfloat16), jnp.asarray(r[3])) for r in routings]
  touched = float(np.mean([r[2] for r in routings]))
  rows = []
  for fmt in args.formats:
    w = (bench.make_bf16 if fmt == "bf16" else bench.make_int4)(jax.random.key(EXPERTS + 1), EXPERTS)
    roofline_us = bench.weight_bytes(fmt, touched) / stream * 1e6
    steps = {g: bench.in_step(layer(g)) for g in GRIDS}
    tokens, ids = [c[0] for c in calls], [c[1] for c in calls]
    outs = {g: np.asarray(jnp.stack(step(tokens, ids, w)).astype(jnp.float32)) for g, step in steps.items()}
    timings = {g: [] for g in GRIDS}
    for _ in range(REPEATS):
      for g, step in steps.items():
        timings[g].append(bench.device_in_step(step, calls, w))
    medians = {g: statistics.median(us for us, _ in timings[g]) for g in GRIDS}
    for g in GRIDS:
      same = np.array_equal(outs[g], outs[None])
      rows.append(dict(experts=EXPERTS, tokens=1, touched=touched, format=fmt, item_programs=g, gpu_us=medians[g],
                       roofline_us=roofline_us, roofline_fraction=roofline_us / medians[g],
                       kernels={k: us for k, us in timings[g][-1][1].items() if "mosaic_gpu" in k},
                       vs_default=medians[g] / medians[None], rows="bit-identical" if same else "DIFFER"))
      print(f"{fmt} G={g or 8}: {medians[g]:.1f} us ({roofline_us / medians[g]:.1%}) {rows[-1]['rows']}", flush=True)
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=False, cell=cell)


if __name__ == "__main__":
  main()
