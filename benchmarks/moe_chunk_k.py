"""INT4 gate/up chunk size (``moe.CHUNK_K``) at expert-parallel shares (H200).

    PYTHONPATH=. python3 benchmarks/moe_chunk_k.py --out benchmarks/results   # on the GPU

INT4's gate/up kernel sums K (7168 at K2.6) in fixed chunks of ``chunk_k`` features, so that where
few experts are touched each chunk can be its own program (``split_k``) and a fold kernel adds the
chunk sums, bit for bit as one program adding them. The chunk size sets both how many programs a
lone expert's tile splits into (7168 / chunk_k) and how many chunk sums every call adds. This
times, for ``bench_moe.py``'s routings (16 calls in one executable, GPU time from CUPTI, every
variant of a cell in turn, ``--repeats`` times):

* ``split``: one token's per-pair items at the 48- and 96-expert shares (``moe_experts_per_row``
  with the share's expected rows: the compact pair grid), gate/up split into chunks of each size,
  and K in one program (``unsplit``) for scale;
* ``sorted``: the sorted path at the 48-expert share, T = 9 and 17, nothing split, each chunk size
  and one sum over K (``chunk_k`` None: no chunks, which the split could not match bit for bit).

Each row: GPU us per layer call, the fraction of the touched experts' read roofline (stream
measured in the same run), the kernels' shares, the time against the first variant of its cell,
and the rows' relative L2 distance from it (chunk sizes round differently; the same size split or
not gives 0). The first variants use chunks of 1024, the default before this script's run made it
1792. Writes ``moe_chunk_k.json`` and ``.md`` (``--name``).
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

CHUNKS = (1024, 1792, 3584)
PAIR_EXPERTS = (48, 96)
SORTED_TOKENS = (9, 17)
SORTED_EXPERTS = 48
REPEATS = 5


def gate_up_tiles(chunk_k, split: bool) -> moe.KernelTiles:
  return dataclasses.replace(moe.INT4_TILES, gate_up=moe.TileConfig(moe.INT4_TILES.gate_up.block_k,
                                                                    moe.INT4_TILES.gate_up.stages, chunk_k, split))


def variants(kind: str) -> dict:
  """name -> (chunk_k, split) for a cell of ``kind`` ("split" or "sorted")."""
  if kind == "split":
    return {**{f"split {c}": (c, True) for c in CHUNKS}, "unsplit 1024": (1024, False)}
  return {**{f"chunks {c}": (c, False) for c in CHUNKS}, "one sum": (None, False)}


def layer(kind: str, tiles: moe.KernelTiles, expected_rows: int):
  if kind == "split":
    return lambda tokens, ids, w: moe.moe_experts_per_row(tokens, ids, w, expected_rows=expected_rows, tiles=tiles)
  return lambda x, g, w: moe.moe_experts(x, g, w, expected_rows=expected_rows, tiles=tiles)


def cell(row: dict) -> tuple:
  return (row["kind"], row["experts"], row["tokens"], list(variants(row["kind"])).index(row["variant"]))


def markdown(result: dict) -> str:
  lines = [f"# INT4 gate/up chunk size ({result['device']}, jax {result['jax']})", "",
           "`bench_moe.py`'s routings, INT4. GPU us per layer call (CUPTI; 16 calls in one executable; the "
           f"median of {result['repeats']} timings, the variants of a cell in turn), the fraction of the touched "
           "experts' read roofline (stream measured in the same run), the kernels' shares, the time against the "
           "cell's first variant and the rows' relative L2 distance from it. *split*: one token's per-pair items "
           "(the share's compact pair grid), gate/up split into chunks of that many features; *sorted*: the sorted "
           "path, nothing split.", "",
           "| kind | E | T | touched | variant | GPU us | of roofline | kernels | vs first | rows rel L2 |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    lines.append(f"| {row['kind']} | {row['experts']} | {row['tokens']} | {row['touched']:.2f} | {row['variant']} | "
                 f"{row['gpu_us']:.1f} | {row['roofline_fraction']:.1%} | {results_io.kernel_shares(row['kernels'])} "
                 f"| {row['vs_first']:.3f}x | {row['rel_l2']:.1e} |")
  return results_io.with_command(lines, result)


def time_cell(kind, experts, tokens, stream, repeats) -> list:
  w = bench.make_int4(jax.random.key(experts + 1), experts)
  cell_ = moe_share.pair_cell(experts) if kind == "split" else moe_share.sorted_cell(experts, tokens)
  roofline_us = bench.weight_bytes("int4", cell_.touched) / stream * 1e6
  named = variants(kind)
  timed = moe_share.time_variants({name: layer(kind, gate_up_tiles(*v), cell_.expected_rows)
                                   for name, v in named.items()}, cell_, w, repeats)
  first = timed[next(iter(named))]
  rows = []
  for name, t in timed.items():
    rel = float(np.linalg.norm(t.rows - first.rows) / np.linalg.norm(first.rows))
    rows.append(dict(kind=kind, experts=experts, tokens=tokens, touched=cell_.touched, variant=name,
                     chunk_k=named[name][0], split=named[name][1], gpu_us=t.gpu_us, roofline_us=roofline_us,
                     roofline_fraction=roofline_us / t.gpu_us, kernels=t.kernels, vs_first=t.gpu_us / first.gpu_us,
                     rel_l2=rel))
    print(f"{kind} E={experts} T={tokens} {name}: {t.gpu_us:.1f} us ({roofline_us / t.gpu_us:.1%}) rel {rel:.1e}",
          flush=True)
  return rows


def main():
  parser = results_io.results_parser(__doc__, "moe_chunk_k")
  parser.add_argument("--repeats", type=int, default=REPEATS)
  args = parser.parse_args()
  results_io.check_positive(parser, repeats=args.repeats)
  results_io.require_gpu("moe_chunk_k.py")
  start = time.perf_counter()
  stream = bench.ceilings()["stream_read_bytes_per_s"]
  rows = []
  for experts in PAIR_EXPERTS:
    rows += time_cell("split", experts, 1, stream, args.repeats)
  for tokens in SORTED_TOKENS:
    rows += time_cell("sorted", SORTED_EXPERTS, tokens, stream, args.repeats)
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=False, cell=cell, repeats=args.repeats)


if __name__ == "__main__":
  main()
