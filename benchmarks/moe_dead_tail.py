"""INT4 gate/up kernel alone (48 experts): does a tail of dead item slots slow it? (H200)

    PYTHONPATH=. python3 benchmarks/moe_dead_tail.py   # on the GPU; prints the table

``moe_experts`` launches a static number of item slots (``moe.max_work_items``: 73 at the
48-expert share and T = 9 for ~8 live items); the slots past the live ones hold -1 and their
programs exit at once. Here n live items (sorted distinct experts, one 16-row x block each: all
at row 0, or spread over 8-aligned starts), with no dead slots or with 60 after them, in both INT4
forms: "registers" (2 programs an SM) and "registers_serial" (4 an SM). GPU time from CUPTI, 16
calls in one executable, us per call. Results: ``benchmarks/results/moe_dead_tail.md``.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import bench_moe as B
import gpu_timing
from pallas_kernels import moe


def main():
  if jax.default_backend() != "gpu":
    sys.exit("moe_dead_tail.py times the Mosaic GPU kernel: run it on the GPU")
  e, r = 48, 16
  rng = np.random.default_rng(0)
  w = B.make_int4(jax.random.key(e + 1), e)
  x = jnp.asarray(rng.standard_normal((80, B.HIDDEN)), jnp.bfloat16)
  for n in (8, 9, 12, 16):
    base = [np.sort(rng.choice(e, n, replace=False)).astype(np.int32) for _ in range(16)]
    starts = [np.sort(rng.choice(9, n, replace=True)).astype(np.int32) * 8 for _ in range(16)]
    for tail in (0, 60):
      for blocks in ("same", "spread"):
        sets = []
        for ids, st in zip(base, starts):
          ex = np.concatenate([ids, np.full(tail, -1, np.int32)])
          bs = np.concatenate([st if blocks == "spread" else np.zeros(n, np.int32), np.zeros(tail, np.int32)])
          sets.append((jnp.asarray(ex), jnp.asarray(bs)))
        row = []
        for dq in ("registers", "registers_serial"):
          kw = dict(block_rows=r, int4_dequant=dq, count_tile_loads=False, interpret=None, grid_order="tile_minor")
          k = jax.jit(lambda x, ex, bs, w: moe._grouped_kernel(x, ex, bs, (w.gate, w.up), fuse_silu=True,
                                                              cfg=moe.INT4_TILES.gate_up, **kw))
          step = jax.jit(lambda x, sets, w: [k(x, ex, bs, w) for ex, bs in sets])
          t, _ = gpu_timing.per_call_device_us(step, (x, sets, w), calls=16)
          row.append(t)
        print(f"n={n:2d} dead tail {tail:2d} x blocks {blocks:6s}: registers {row[0]:6.1f}  serial {row[1]:6.1f}",
              flush=True)


if __name__ == "__main__":
  main()
