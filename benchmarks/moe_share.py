"""Cells of the MoE ablation scripts at an expert-parallel share, and their variants timed in turn.

A cell is ``bench_moe.py``'s 16 routings of T tokens restricted to the share's experts, as the
calls of one executable: per-pair calls (one token: its [1, H] row and its [1, 8] expert ids, ids of
experts held elsewhere = E) or sorted calls (x_sorted [8T, H] and group_sizes [E]). ``time_variants``
runs each variant's executable in turn, ``repeats`` times, so that the variants of a cell meet the
same machine state (the INT4 cells move by up to 13% between processes: ``docs/moe.md``).
"""

import statistics
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

import bench_moe as bench


class Cell(NamedTuple):
  calls: list  # [(x, g)]: the layer's first two arguments per routing
  touched: float  # distinct experts of the share touched per routing, on average
  expected_rows: int  # rows expected on the share's experts (the kernels' ``expected_rows``)


def pair_cell(experts: int) -> Cell:
  """One token per routing, as per-pair calls; the share expects 8 x E / 384 live pairs (at least 1)."""
  routings = bench.routings(1, experts, seed=1000 * experts + 1)
  rng = np.random.default_rng(experts)
  calls = [(jnp.asarray(rng.standard_normal((1, bench.HIDDEN)), jnp.bfloat16), jnp.asarray(r[3])) for r in routings]
  return Cell(calls, float(np.mean([r[2] for r in routings])), max(1, bench.TOP_K * experts // bench.ALL_EXPERTS))


def sorted_cell(experts: int, tokens: int) -> Cell:
  """``tokens`` tokens per routing, as sorted calls (``bench_moe.expected_rows`` of them expected here)."""
  routings = bench.routings(tokens, experts, seed=1000 * experts + tokens)
  calls = [(r[0], r[1]) for r in routings]
  return Cell(calls, float(np.mean([r[2] for r in routings])), bench.expected_rows(*calls[0]))


class Timed(NamedTuple):
  gpu_us: float  # median GPU us per layer call
  kernels: dict  # {Mosaic GPU kernel: us per call} of the last timing
  rows: np.ndarray  # float32 outputs of every call, stacked


def time_variants(layers: dict, cell: Cell, w, repeats: int) -> dict:
  """{name: Timed} for ``layers`` ({name: layer(x, g, w)}), each in one ``bench_moe.in_step``
  executable over the cell's calls, timed in turn ``repeats`` times."""
  steps = {name: bench.in_step(layer) for name, layer in layers.items()}
  xs, gs = [c[0] for c in cell.calls], [c[1] for c in cell.calls]
  rows = {name: np.asarray(jnp.stack(step(xs, gs, w)).astype(jnp.float32)) for name, step in steps.items()}
  timings = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      timings[name].append(bench.device_in_step(step, cell.calls, w))
  return {name: Timed(statistics.median(us for us, _ in timings[name]),
                      {k: us for k, us in timings[name][-1][1].items() if "mosaic_gpu" in k}, rows[name])
          for name in steps}
