"""INT4's two register dequantisation forms at the 48-expert share, and the compact grid's size (H200).

    PYTHONPATH=. python3 benchmarks/moe_dequant_form.py --out benchmarks/results   # on the GPU

``int4_dequant="registers"`` issues both weights' MMAs before one drain (194 registers a thread:
two gate/up programs an SM); ``"registers_serial"`` drains after each weight (114 registers: four
an SM). ``moe.default_int4_dequant`` picks one by the gate/up programs a step is expected to run
(touched experts x output tiles) against ``moe.SERIAL_PROGRAMS_PER_SM`` a SM. This times, for
``bench_moe.py``'s routings at the 48-expert share (INT4; one executable of 16 layer calls per
cell, GPU time from CUPTI, every variant of a cell in turn, ``REPEATS`` times), each form with the
default compact grid (``moe.default_item_programs`` for the kernel-built list: 1.25 times the
expected touched experts) and with a grid of twice them (the default until 2026-11-30: more
programs past the live items, fewer second rounds where a step touches more). Every variant's
rows must equal the default's bit for bit (the forms and the grid change the schedule, not the
sums). Writes ``moe_dequant_form.json`` and ``.md`` (``--name``).
"""

import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_moe as bench
import results_io
from pallas_kernels import moe

TOKENS = (5, 9, 13, 17, 33, 65)
EXPERTS = 48
FORMS = ("registers", "registers_serial")
GRID_SCALES = (None, 2.0)  # None: moe.default_item_programs
REPEATS = 4


def item_programs(scale, rows: int):
  """The grid's programs along the items for ``scale`` x the expected touched experts (None: the default)."""
  if scale is None:
    return None
  return max(moe.ITEM_PROGRAMS_MIN, math.ceil(scale * moe.expected_touched(EXPERTS, rows)))


def layer(form: str, programs, rows: int):
  def call(x, g, w):
    return moe.moe_experts(x, g, w, expected_rows=rows, int4_dequant=form, item_programs=programs)
  return call


def variant_name(form: str, scale) -> str:
  return form + ("" if scale is None else f", grid {scale}x touched")


def cell(row: dict) -> tuple:
  return (row["tokens"], FORMS.index(row["form"]), -1 if row["grid_scale"] is None else row["grid_scale"])


def markdown(result: dict) -> str:
  lines = [f"# INT4 dequantisation forms and the compact grid at the 48-expert share ({result['device']}, "
           f"jax {result['jax']})", "",
           f"`bench_moe.py`'s routings, INT4. GPU us per layer call (CUPTI; 16 routings in one executable; "
           f"the median of {REPEATS} timings, the variants of a cell in turn), the fraction of the touched "
           "experts' read roofline (stream measured in the same run), the kernels' shares, the time against "
           "the default's, and whether all 16 routings' rows equal the default's bit for bit. *default*: the "
           "form `moe.default_int4_dequant` picks with the default grid; *G*: programs along the items.", "",
           "| T | touched | form | G | GPU us | of roofline | kernels | vs default | rows |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    form = row["form"] + (" (default)" if row["default"] else "")
    lines.append(f"| {row['tokens']} | {row['touched']:.1f} | {form} | {row['item_programs']} | {row['gpu_us']:.1f} | "
                 f"{row['roofline_fraction']:.1%} | {results_io.kernel_shares(row['kernels'])} | "
                 f"{row['vs_default']:.3f}x | {row['rows']} |")
  return results_io.with_command(lines, result)


def main():
  parser = results_io.results_parser(__doc__, "moe_dequant_form")
  parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
  args = parser.parse_args()
  results_io.require_gpu("moe_dequant_form.py")
  start = time.perf_counter()
  stream = bench.ceilings()["stream_read_bytes_per_s"]
  w = bench.make_int4(jax.random.key(EXPERTS + 1), EXPERTS)
  rows = []
  for t in args.tokens:
    routings = bench.routings(t, EXPERTS, seed=1000 * EXPERTS + t)
    calls = [(r[0], r[1]) for r in routings]
    touched = float(np.mean([r[2] for r in routings]))
    roofline_us = bench.weight_bytes("int4", touched) / stream * 1e6
    expected = bench.expected_rows(*calls[0])
    default_form = moe.default_int4_dequant(EXPERTS, expected, bench.INTER)
    variants = [(form, scale) for form in FORMS for scale in GRID_SCALES]
    variants.sort(key=lambda v: (v != (default_form, None)))  # the default first: the rows' reference
    steps = {v: bench.in_step(layer(v[0], item_programs(v[1], expected), expected)) for v in variants}
    xs, gs = [c[0] for c in calls], [c[1] for c in calls]
    outs = {v: np.asarray(jnp.stack(step(xs, gs, w)).astype(jnp.float32)) for v, step in steps.items()}
    timings = {v: [] for v in variants}
    for _ in range(REPEATS):
      for v, step in steps.items():
        timings[v].append(bench.device_in_step(step, calls, w))
    medians = {v: statistics.median(us for us, _ in timings[v]) for v in variants}
    w_items = moe.max_work_items(EXPERTS, xs[0].shape[0], moe.default_block_rows(EXPERTS, expected, is_int4=True))
    for v in variants:
      form, scale = v
      programs = item_programs(scale, expected) or moe.default_item_programs(
          EXPERTS, expected, w_items, moe.default_work_list_impl(EXPERTS))
      same = np.array_equal(outs[v], outs[variants[0]])
      rows.append(dict(experts=EXPERTS, tokens=t, touched=touched, form=form, grid_scale=scale,
                       item_programs=programs, default=v == (default_form, None), gpu_us=medians[v],
                       roofline_us=roofline_us, roofline_fraction=roofline_us / medians[v],
                       kernels={k: us for k, us in timings[v][-1][1].items() if "mosaic_gpu" in k},
                       vs_default=medians[v] / medians[variants[0]], rows="bit-identical" if same else "DIFFER"))
      print(f"T={t} {variant_name(*v)} G={programs}: {medians[v]:.1f} us ({roofline_us / medians[v]:.1%}) "
            f"{rows[-1]['rows']}", flush=True)
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=False, cell=cell)


if __name__ == "__main__":
  main()
