"""INT4 pipeline depths where few programs run: the 48-expert share at T = 1, 2, 5 and 9 (H200).

    PYTHONPATH=. python3 benchmarks/moe_int4_stages.py --out benchmarks/results   # on the GPU

INT4's gate/up and down kernels run a two-deep ring of 256-feature steps (``moe.INT4_TILES``),
tuned where many programs share each SM and the steps are bound by dequantising. Where a step
runs about one program an SM (the share at T = 1 and 2: a lone expert's split gate/up is 128
programs, its down 112), a program alone on its SM streams at its bytes in flight over the memory
latency, so a deeper ring may pay there, as it did for bf16 (``moe.BF16_FEW_PROGRAMS_TILES``).
This times, for ``bench_moe.py``'s routings (16 calls in one executable, GPU time from CUPTI,
every variant of a cell in turn, ``--repeats`` times), the default tiles (``moe.default_tiles``
for the cell's expected rows, split or not) against the same tiles with deeper gate/up and down
rings (``--depths``: gate/up stages x down stages; the kernels make a ring shallower where it would
not fit in shared memory). Same steps, so the rows must equal the default's bit for bit. Writes
``moe_int4_stages.json`` and ``.md`` (``--name``).
"""

import dataclasses
import sys
import time

import jax
import numpy as np

import bench_moe as bench
import moe_share
import results_io
from pallas_kernels import moe

EXPERTS = 48
TOKENS = (1, 2, 5, 9)  # T = 1: per-pair calls; else sorted
DEPTHS = ("2x2", "4x2", "2x4", "2x8", "4x4", "4x8")  # gate/up stages x down stages; the first is the default's
REPEATS = 5


def parse_depth(depth: str) -> tuple:
  """'4x2' -> (gate/up stages, down stages), each >= 2."""
  parts = depth.split("x")
  if len(parts) != 2 or not all(p.isdigit() and int(p) >= 2 for p in parts):
    raise ValueError(f"--depths {depth!r}: expected gate/up stages x down stages, each >= 2 (e.g. 4x2)")
  return int(parts[0]), int(parts[1])


def tiles_at(base: moe.KernelTiles, depth: str) -> moe.KernelTiles:
  gate_up, down = parse_depth(depth)
  return dataclasses.replace(base, gate_up=dataclasses.replace(base.gate_up, stages=gate_up),
                             down=dataclasses.replace(base.down, stages=down))


def layer(tokens: int, tiles: moe.KernelTiles, expected_rows: int):
  if tokens == 1:
    return lambda x, ids, w: moe.moe_experts_per_row(x, ids, w, expected_rows=expected_rows, tiles=tiles)
  return lambda x, g, w: moe.moe_experts(x, g, w, expected_rows=expected_rows, tiles=tiles)


def cell(row: dict) -> tuple:
  return (row["tokens"], row["depth"])


def markdown(result: dict) -> str:
  lines = [f"# INT4 pipeline depths at the 48-expert share ({result['device']}, jax {result['jax']})", "",
           "`bench_moe.py`'s routings, INT4 (T = 1: one token's per-pair items; else the sorted path). GPU us per "
           f"layer call (CUPTI; 16 calls in one executable; the median of {result['repeats']} timings, the variants "
           "of a cell in turn), the fraction of the touched experts' read roofline (stream measured in the same run), "
           "the kernels' shares, the time against the default tiles' and whether the rows equal theirs bit for bit. "
           "*depth*: gate/up stages x down stages asked for (the first: the default's); *split*: whether the "
           "default tiles split the gate/up kernel into chunks.", "",
           "| T | touched | split | depth | GPU us | of roofline | kernels | vs default | rows |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    lines.append(f"| {row['tokens']} | {row['touched']:.2f} | {'yes' if row['split'] else 'no'} | {row['depth']} | "
                 f"{row['gpu_us']:.1f} | {row['roofline_fraction']:.1%} | {results_io.kernel_shares(row['kernels'])} "
                 f"| {row['vs_default']:.3f}x | {row['rows']} |")
  return results_io.with_command(lines, result)


def main():
  parser = results_io.results_parser(__doc__, "moe_int4_stages")
  parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
  parser.add_argument("--depths", nargs="+", default=list(DEPTHS), help="gate/up x down stages, the default's first")
  parser.add_argument("--repeats", type=int, default=REPEATS)
  args = parser.parse_args()
  try:
    depths = [parse_depth(depth) for depth in args.depths]
  except ValueError as e:
    parser.error(str(e))
  default = (moe.INT4_TILES.gate_up.stages, moe.INT4_TILES.down.stages)
  if depths[0] != default:
    parser.error(f"--depths must start with the default tiles' {default[0]}x{default[1]} (the reference)")
  results_io.check_positive(parser, repeats=args.repeats, tokens=min(args.tokens))
  results_io.require_gpu("moe_int4_stages.py")
  start = time.perf_counter()
  stream = bench.ceilings()["stream_read_bytes_per_s"]
  w = bench.make_int4(jax.random.key(EXPERTS + 1), EXPERTS)
  rows = []
  for tokens in args.tokens:
    cell_ = moe_share.pair_cell(EXPERTS) if tokens == 1 else moe_share.sorted_cell(EXPERTS, tokens)
    base = moe.default_tiles(w, cell_.expected_rows)
    roofline_us = bench.weight_bytes("int4", cell_.touched) / stream * 1e6
    timed = moe_share.time_variants({d: layer(tokens, tiles_at(base, d), cell_.expected_rows) for d in args.depths},
                                    cell_, w, args.repeats)
    default = timed[args.depths[0]]
    for depth, t in timed.items():
      same = np.array_equal(t.rows, default.rows)
      rows.append(dict(experts=EXPERTS, tokens=tokens, touched=cell_.touched, split=base.gate_up.split_k, depth=depth,
                       gpu_us=t.gpu_us, roofline_us=roofline_us, roofline_fraction=roofline_us / t.gpu_us,
                       kernels=t.kernels, vs_default=t.gpu_us / default.gpu_us,
                       rows="bit-identical" if same else "DIFFER"))
      print(f"T={tokens} {depth}: {t.gpu_us:.1f} us ({roofline_us / t.gpu_us:.1%}) {rows[-1]['rows']}", flush=True)
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=False, cell=cell, repeats=args.repeats)


if __name__ == "__main__":
  main()
