"""The sorted path's work list built inside the gate/up kernel against the plain-jnp list (H200).

    PYTHONPATH=. python3 benchmarks/moe_work_list.py --out benchmarks/results   # on the GPU

For ``bench_moe.py``'s routings at the 48-expert share (T tokens, top-8 over 384 experts; the
share keeps the rows of its experts, the rest is padding), one executable of 16 layer calls per
cell, GPU time from CUPTI, both variants of a cell timed in the same run, in turn, twice:

* ``kernel``: ``moe.moe_experts(..., work_list_impl="kernel")``, the default up to
  ``moe.KERNEL_WORK_LIST_MAX_EXPERTS`` experts: each gate/up program finds its slots' items from
  the counts (``moe.slot_item``) and the kernel writes the list for the down kernel and the take.
* ``jnp``: ``work_list_impl="jnp"``: ``moe.work_list``, a few small XLA kernels before the first
  MoE kernel.

Each row has the kernels' shares and the plain-jnp kernels' sum (*glue*), the fraction of the
touched experts' read roofline (``bench_moe.weight_bytes`` over the read-only stream measured in
the same run, as ``bench_moe.py``), and whether the rows of all 16 routings are the same bit for
bit as the other variant's. Writes ``moe_work_list.json`` and ``.md`` (``--name``; ``--merge``
keeps the rows of cells this run does not time).
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

TOKENS = (2, 9, 17, 33, 65, 136)
EXPERTS = 48
VARIANTS = ("kernel", "jnp")
REPEATS = 2  # each variant's executable timed this many times, alternating


def layer(impl: str):
  def call(x, g, w):
    return moe.moe_experts(x, g, w, expected_rows=bench.expected_rows(x, g), work_list_impl=impl)
  return call


def cell(row: dict) -> tuple:
  return (row["format"], row["experts"], row["tokens"], VARIANTS.index(row["variant"]))


def markdown(result: dict) -> str:
  lines = [f"# The MoE work list in the gate/up kernel against the plain-jnp list ({result['device']}, "
           f"jax {result['jax']})", "",
           f"The 48-expert share, `bench_moe.py`'s routings. GPU us per layer call (CUPTI; 16 routings in one "
           f"executable; the median of {REPEATS} timings, each variant's alternating with the other's), "
           "the fraction of the touched experts' read roofline (stream measured in the same run), the "
           "plain-jnp kernels' sum (*glue*), the kernels' shares, and whether all 16 routings' rows equal "
           "the other list's bit for bit.", "",
           "| T | format | touched | list | GPU us | of roofline | glue us | kernels | vs jnp | rows |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    lines.append(f"| {row['tokens']} | {row['format']} | {row['touched']:.1f} | {row['variant']} | "
                 f"{row['gpu_us']:.1f} | {row['roofline_fraction']:.0%} | {row['glue_us']:.1f} | "
                 f"{results_io.kernel_shares(row['kernels'])} | {row['vs_jnp']:.3f}x | {row['rows']} |")
  return results_io.with_command(lines, result)


def main():
  parser = results_io.results_parser(__doc__, "moe_work_list", merge=True)
  parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
  parser.add_argument("--formats", nargs="+", default=["int4", "bf16"], choices=["int4", "bf16"])
  args = parser.parse_args()
  results_io.require_gpu("moe_work_list.py")
  start = time.perf_counter()
  stream = bench.ceilings()["stream_read_bytes_per_s"]
  rows = []
  for fmt in args.formats:
    w = (bench.make_bf16 if fmt == "bf16" else bench.make_int4)(jax.random.key(EXPERTS + 1), EXPERTS)
    for t in args.tokens:
      routings = bench.routings(t, EXPERTS, seed=1000 * EXPERTS + t)
      calls = [(r[0], r[1]) for r in routings]
      touched = float(np.mean([r[2] for r in routings]))
      roofline_us = bench.weight_bytes(fmt, touched) / stream * 1e6
      steps = {impl: bench.in_step(layer(impl)) for impl in VARIANTS}
      xs, gs = [c[0] for c in calls], [c[1] for c in calls]
      outs = {impl: np.asarray(jnp.stack(step(xs, gs, w)).astype(jnp.float32)) for impl, step in steps.items()}
      same = np.array_equal(outs["kernel"], outs["jnp"])
      timings = {impl: [] for impl in VARIANTS}
      for _ in range(REPEATS):
        for impl, step in steps.items():
          timings[impl].append(bench.device_in_step(step, calls, w))
      medians = {impl: statistics.median(us for us, _ in timings[impl]) for impl in VARIANTS}
      for impl in VARIANTS:
        kinds = timings[impl][-1][1]
        rows.append(dict(experts=EXPERTS, tokens=t, format=fmt, touched=touched, variant=impl,
                         gpu_us=medians[impl], roofline_us=roofline_us, roofline_fraction=roofline_us / medians[impl],
                         glue_us=sum(us for k, us in kinds.items() if "mosaic_gpu" not in k),
                         kernels={k: us for k, us in kinds.items() if "mosaic_gpu" in k},
                         vs_jnp=medians[impl] / medians["jnp"], rows="bit-identical" if same else "DIFFER"))
        print(f"T={t} {fmt} {impl}: {medians[impl]:.1f} us ({roofline_us / medians[impl]:.0%} of roofline) "
              f"{rows[-1]['rows']}", flush=True)
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=args.merge, cell=cell)


if __name__ == "__main__":
  main()
