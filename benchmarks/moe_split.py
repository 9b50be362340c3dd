"""INT4's chunked, split gate/up kernel and the compact item grid against the kernel without them (H200).

    PYTHONPATH=. python3 benchmarks/moe_split.py --out benchmarks/results   # on the GPU

For ``bench_moe.py``'s routings (T tokens, top-8 over 384 experts; the 48-expert share keeps the
rows of its experts, the rest is padding), one executable of 16 layer calls per cell, GPU time
from CUPTI, every variant of a cell timed in the same run:

* ``default``: ``moe.moe_experts`` with the share's expected rows, as ``bench_moe.py`` calls it.
  INT4's gate/up sums K in chunks of ``moe.CHUNK_K`` and splits them into programs where its
  programs fit one an SM; the sorted path runs on the compact grid (``moe.default_item_programs``).
* ``no split``: the default without the split (the chunks summed by one program).
* ``split``: the default with the gate/up split wherever it has more than one chunk (where the
  default does not split: do more, shorter programs even out the waves of a step's programs?).
* ``full grid``: the default with a program per item slot (``item_programs`` past the slots).
* ``one sum, full grid`` (INT4): K in one sum (``chunk_k=None``), no split, a program per item
  slot: the kernel as it was before the chunks and the compact grid, its numerics included.

Rows are checked against the default's for the first routing: bit for bit where only the split
or the grid differ (the chunks' sums are added in one order either way), by relative L2 where
the sums over K differ. Writes ``moe_split.json`` and ``moe_split.md`` (``--name``); all cells take about 8
minutes (mostly compilation), so under a 10-minute limit time them in parts (``--cells``,
``--formats``) with ``--merge``, which keeps the rows of cells this run does not time.
"""

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_moe as bench
import results_io
from pallas_kernels import moe

CELLS = ((48, 1), (48, 2), (48, 9), (48, 17), (48, 65), (48, 136), (384, 1), (384, 136))
FULL_GRID = 1 << 30  # item_programs past any work list's slots: a program per slot


def variants(fmt: str) -> dict:
  """{name: (tiles from the default tiles, item_programs)}."""
  def no_split(tiles):
    return dataclasses.replace(tiles, gate_up=dataclasses.replace(tiles.gate_up, split_k=False),
                               down=dataclasses.replace(tiles.down, split_k=False))

  def split(tiles):
    return dataclasses.replace(tiles, gate_up=dataclasses.replace(tiles.gate_up, split_k=True))

  def one_sum(tiles):
    return dataclasses.replace(tiles, gate_up=dataclasses.replace(tiles.gate_up, split_k=False, chunk_k=None),
                               down=dataclasses.replace(tiles.down, split_k=False, chunk_k=None))
  if fmt == "bf16":  # one sum and no split already: its full grid is its previous kernel
    return {"default": (lambda t: t, None), "full grid": (lambda t: t, FULL_GRID)}
  return {"default": (lambda t: t, None), "no split": (no_split, None), "split": (split, None),
          "full grid": (lambda t: t, FULL_GRID), "one sum, full grid": (one_sum, FULL_GRID)}


def layer(adjust, item_programs):
  def call(x, g, w):
    rows = bench.expected_rows(x, g)
    return moe.moe_experts(x, g, w, expected_rows=rows, tiles=adjust(moe.default_tiles(w, rows)),
                           item_programs=item_programs)
  return call


def cell(row: dict) -> tuple:
  """A row's cell, (format, experts, tokens): ``--merge`` keeps an earlier run's rows of the
  cells this run did not time."""
  return (row["format"], row["experts"], row["tokens"])


def markdown(result: dict) -> str:
  lines = [f"# INT4's split gate/up and the compact item grid, side by side ({result['device']}, jax {result['jax']})",
           "", "GPU us per layer call (CUPTI; 16 routings in one executable), the kernels' shares after it; "
           "`rows`: against the default's rows for the first routing.", "",
           "| experts | T | format | touched | variant | GPU us | vs default | kernels | rows |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    kinds = results_io.kernel_shares(row["kernels"])
    lines.append(f"| {row['experts']} | {row['tokens']} | {row['format']} | {row['touched']:.1f} | {row['variant']} | "
                 f"{row['gpu_us']:.1f} | {row['vs_default']:.2f}x | {kinds} | {row['rows']} |")
  return results_io.with_command(lines, result)


def main():
  parser = results_io.results_parser(__doc__, "moe_split", merge=True)
  parser.add_argument("--cells", nargs="+", default=[f"{e}:{t}" for e, t in CELLS],
                      help="experts:tokens pairs, e.g. 48:1 384:136")
  parser.add_argument("--formats", nargs="+", default=["int4", "bf16"], choices=["int4", "bf16"])
  parser.add_argument("--variants", nargs="+", help="time only these variants (the default always: the others' baseline)")
  args = parser.parse_args()
  known = {name for fmt in args.formats for name in variants(fmt)}
  if args.variants and set(args.variants) - known:
    parser.error(f"--variants {sorted(set(args.variants) - known)}: not variants of {args.formats}; known: {sorted(known)}")
  results_io.require_gpu("moe_split.py")
  start = time.perf_counter()
  rows = []
  for fmt in args.formats:
    weights = {}
    for cell in args.cells:
      e, t = map(int, cell.split(":"))
      if e not in weights:
        weights.clear()  # one expert count's weights on the device at a time
        weights[e] = (bench.make_bf16 if fmt == "bf16" else bench.make_int4)(jax.random.key(e + 1), e)
      w = weights[e]
      routings = bench.routings(t, e, seed=100 + t)
      calls = [(r[0], r[1]) for r in routings]
      touched = float(np.mean([r[2] for r in routings]))
      cell_rows, base = [], None
      for name, (adjust, item_programs) in variants(fmt).items():
        if args.variants and name != "default" and name not in args.variants:
          continue
        fn = layer(adjust, item_programs)
        us, kinds = bench.device_in_step(bench.in_step(fn), calls, w)
        y = np.asarray(jax.jit(fn)(*calls[0], w).astype(jnp.float32))
        if base is None:
          base, check = (y, us), "-"
        elif name == "one sum, full grid":
          check = f"rel L2 {np.linalg.norm(y - base[0]) / max(np.linalg.norm(base[0]), 1e-30):.1e}"
        else:
          check = "bit-identical" if np.array_equal(y, base[0]) else "DIFFER"
        kernels = {k: v for k, v in kinds.items() if "mosaic_gpu" in k}
        cell_rows.append(dict(experts=e, tokens=t, format=fmt, touched=touched, variant=name, gpu_us=us,
                              vs_default=us / base[1], kernels=kernels, rows=check))
        print(f"E={e} T={t} {fmt} {name}: {us:.1f} us ({cell_rows[-1]['vs_default']:.2f}x) {check}", flush=True)
      rows += cell_rows
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=args.merge, cell=cell)


if __name__ == "__main__":
  main()
