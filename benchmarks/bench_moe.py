"""One K2.6 MoE layer's routed experts on the H200: the Mosaic GPU kernel against the baselines.

    PYTHONPATH=. python3 benchmarks/bench_moe.py --out benchmarks/results   # on the GPU

All three projections (gate, up: 7168 -> 2048; down: 2048 -> 7168) of 384 experts, and of the
48-expert share one GPU holds under 8-way expert parallelism, at T tokens with random top-8
routing over the 384 experts (the 48-expert share computes the rows routed to experts 0..47; its
row buffer keeps the static size 8T, the rest is padding). Timed side by side in the same run:

* ``pallas`` bf16 and INT4 (``pallas_kernels/moe.py``): reads only the touched experts;
  ``pallas_rows`` the same with the sorted rows' experts given, as the model gives them: where
  8T <= E the work list is built from them (``moe.work_list_from_rows``), against the [E, E]
  prefix fusion of the default; past it (``--rows-tokens``) they give the rows' columns in place
  of the default's [A, E] pass (prefill sizes). The ids are built outside the timed step (the
  model takes them from its sort with one gather of A ints, not timed here); checked
  bit-identical to ``pallas``;
* ``ragged_dot``: ``models.kimi.routed_experts`` (``jax.lax.ragged_dot``), bf16;
* ``ragged_dot_mgpu``: jax's Pallas Mosaic GPU ragged dot (block 64 x 256 x 64, 4 stages) for
  each projection with the SwiGLU in XLA, bf16.
* ``block_pallas`` (bf16 and INT4) and ``block_ragged_dot`` (bf16): the model's whole routed block
  (``models.kimi.routed_block``: from tokens [T, H] and the routing, sort the rows by expert,
  gather them, run the experts, weight the rows and add each token's rows: on the GPU a gather
  and an elementwise sum, not an atomic scatter-add), so
  that the table shows the glue a model layer pays around the experts, for both paths alike
  (384 experts only: the model has no expert-parallel path yet). Its rows are each token repeated
  for its 8 experts, as the model gathers them, where the sorted-rows cells draw every row apart.

Roofline: bytes of the touched experts' weights in the format used (bf16: 2 bytes per weight;
INT4: half a byte plus a bf16 scale per 32) over the read-only stream bandwidth measured in the
same run (a float32 sum over 4 GiB of bf16). Timing: one jitted executable runs the layer once
on each of 16 distinct routings (so no call finds its experts in L2 from the one before), as a
model step runs its layers, and each cell is timed two ways (medians of 5 such steps):

* GPU time (the fraction of the roofline is taken on it): the kernels of the step as CUPTI
  records them, summed and divided by 16, the plain-jnp kernels around the Mosaic ones included,
  as ``bench_tree_attention.py`` times its calls;
* wall time per call: the step's wall clock over 16. It adds the host-side work XLA does per step
  (argument handling, updating and launching the step's CUDA graph), which at small T is a large
  part of the call (about 20-30 us per layer call on the H200; ``benchmarks/moe_timeline.py``).

Writes ``bench_moe.json`` and ``bench_moe.md`` (``--stem`` names others). ``--resume FILE`` keeps an
earlier run's rows for the cells this run does not time (each keeps its run's ceilings, and the
markdown names the run), so one expert count can be timed again without the other.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import gpu_timing
from models import kimi
from pallas_kernels import moe

HIDDEN, INTER, TOP_K, ALL_EXPERTS = 7168, 2048, 8, 384
TOKENS = (1, 9, 17, 33, 65, 136, 544)
ROUTINGS = 16  # distinct routings per cell: one step runs the layer once on each


def timed(fn, arg_sets, min_seconds=0.1, repeats=3):
  """Median seconds per call; calls are dispatched back to back, blocking once per batch.

  Host dispatch (tens of us per call) bounds this from below: use it for the ceilings, and
  ``timed_in_step`` for layers that may take less than their dispatch.
  """
  out = None
  for args in arg_sets:  # warm-up
    out = fn(*args)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for args in arg_sets:
    out = fn(*args)
  jax.block_until_ready(out)
  one = (time.perf_counter() - t0) / len(arg_sets)
  calls = len(arg_sets) * max(1, int(min_seconds / max(one, 1e-6) / len(arg_sets)))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for i in range(calls):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / calls)
  return statistics.median(samples)


def in_step(layer):
  """One executable running ``layer(x, g, w)`` once per routing, as a model step would run a
  layer: the calls' kernels and the plain-jnp work between them, launch gaps included, with one
  host dispatch for all of them."""
  layer = jax.jit(layer)  # lowered once, called per routing

  @jax.jit
  def step(xs, gs, w):
    return [layer(x, g, w) for x, g in zip(xs, gs)]
  return step


def compile_cells(cells, lower, threads: int, serial=lambda cell: False) -> dict:
  """{cell: compiled executable, or the exception that stopped it}: one broken cell must not lose
  the others. Lowers in this thread (Mosaic GPU lowering is Python), compiles in parallel (outside
  the GIL); cells for which ``serial`` holds compile afterwards, one at a time (XLA autotunes their
  GEMMs on the device: 14 concurrent autotunings of ragged_dot ran out of GPU memory at T = 136)."""
  lowered = {}
  for cell in cells:
    try:
      lowered[cell] = lower(cell)
    except Exception as err:
      lowered[cell] = err

  def compile_cell(cell):
    try:
      return lowered[cell] if isinstance(lowered[cell], Exception) else lowered[cell].compile()
    except Exception as err:
      return err

  parallel = [cell for cell in cells if not serial(cell)]
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    compiled = dict(zip(parallel, pool.map(compile_cell, parallel)))
  compiled.update((cell, compile_cell(cell)) for cell in cells if serial(cell))
  return {cell: compiled[cell] for cell in cells}


def timed_in_step(step, routings_, w, repeats=5):
  """Median seconds per layer call of an ``in_step`` executable over ``routings_``."""
  xs, gs = [r[0] for r in routings_], [r[1] for r in routings_]
  jax.block_until_ready(step(xs, gs, w))  # warm-up
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(step(xs, gs, w))
    samples.append((time.perf_counter() - t0) / len(routings_))
  return statistics.median(samples)


def device_in_step(step, routings_, w, repeats=5):
  """(median GPU us per layer call of an ``in_step`` executable, from CUPTI; {kernel kind: us per call})."""
  xs, gs = [r[0] for r in routings_], [r[1] for r in routings_]
  return gpu_timing.per_call_device_us(step, (xs, gs, w), calls=len(routings_), iterations=repeats)


def ceilings():
  """Read-only stream and copy bandwidth (bytes/s), bf16 matmul rate (FLOP/s), measured here by
  GPU time (CUPTI), as the kernels are: wall-clock ceilings read ~1.4% lower than the attention
  bench's CUPTI ones, which would flatter every fraction by as much. Wall clock only where CUPTI
  fails (``ceilings_timing`` says which)."""
  x = jax.random.normal(jax.random.key(0), (2**31,), jnp.bfloat16)  # 4 GiB
  a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
  calls = {"stream": (jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32)), (x,)),
           "copy": (jax.jit(lambda v: v * 2), (x,)), "matmul": (jax.jit(lambda p, q: p @ q), (a, b))}
  try:
    seconds = {k: gpu_timing.per_call_device_us(fn, args, calls=1, iterations=10)[0] * 1e-6
               for k, (fn, args) in calls.items()}
    how = "cupti"
  except Exception as err:  # noqa: BLE001 - fall back and say so in the results
    print(f"  cupti failed ({type(err).__name__}: {err}); wall clock instead", flush=True)
    seconds, how = {k: timed(fn, [args]) for k, (fn, args) in calls.items()}, "wall"
  nbytes = x.size * 2
  return {"stream_read_bytes_per_s": nbytes / seconds["stream"], "copy_bytes_per_s": 2 * nbytes / seconds["copy"],
          "matmul_bf16_flop_per_s": 2 * 8192**3 / seconds["matmul"], "ceilings_timing": how}


@functools.partial(jax.jit, static_argnames=("num_experts",))
def make_bf16(key, num_experts):
  """Random bf16 experts: 8 distinct ones tiled (contents do not change the traffic)."""
  keys = jax.random.split(key, 3)
  reps = -(-num_experts // 8)
  def one(k, shape):
    return jnp.tile((jax.random.normal(k, (8, *shape)) * 0.02).astype(jnp.bfloat16), (reps, 1, 1))[:num_experts]
  return moe.Bf16Experts(one(keys[0], (HIDDEN, INTER)), one(keys[1], (HIDDEN, INTER)), one(keys[2], (INTER, HIDDEN)))


@functools.partial(jax.jit, static_argnames=("num_experts",))
def make_int4(key, num_experts):
  """Random INT4 experts in the kernel's packed layout (any word is a valid set of nibbles)."""
  keys = jax.random.split(key, 6)
  reps = -(-num_experts // 8)
  def one(kq, ks, k_in, n_out):
    words = jax.random.bits(kq, (8, n_out, k_in // 8), jnp.uint32)
    s = (jax.random.uniform(ks, (8, n_out, k_in // 32)) * 0.01).astype(jnp.bfloat16)
    return moe.KernelInt4Matrix(jnp.tile(words, (reps, 1, 1))[:num_experts], jnp.tile(s, (reps, 1, 1))[:num_experts],
                                k_in)
  return moe.Int4Experts(one(keys[0], keys[1], HIDDEN, INTER), one(keys[2], keys[3], HIDDEN, INTER),
                         one(keys[4], keys[5], INTER, HIDDEN))


def routings(num_tokens, num_experts, seed):
  """ROUTINGS random top-8 routings over all 384 experts, restricted to experts < num_experts.

  Returns [(x_sorted bf16 [8T, H], group_sizes int32[num_experts], distinct experts touched,
  expert ids int32[T, 8] with num_experts for the experts held elsewhere)].
  """
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(ROUTINGS):
    ids = np.argsort(-rng.random((num_tokens, ALL_EXPERTS)), axis=1)[:, :TOP_K].reshape(-1)
    local = np.where(ids < num_experts, ids, num_experts)  # other GPUs' rows sort last as padding
    sizes = np.bincount(local, minlength=num_experts + 1)[:num_experts].astype(np.int32)
    x = jnp.asarray(rng.standard_normal((ids.size, HIDDEN)), jnp.bfloat16)
    out.append((x, jnp.asarray(sizes), int((sizes > 0).sum()), local.reshape(num_tokens, TOP_K).astype(np.int32)))
  return out


def ragged_dot_mgpu_layer(x, group_sizes, experts):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  dot = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=group_sizes, block_m=64, block_n=256,
                          block_k=64, max_concurrent_steps=4, grid_block_n=1)
  hidden = jax.nn.silu(dot(x, experts.gate)) * dot(x, experts.up)
  return dot(hidden, experts.down)


def expected_rows(x, g):
  """Rows expected on these experts: under expert parallelism the share's buffer is 8T rows, but
  only about 8T x E / 384 of them are routed to its E experts (sets the kernel's defaults)."""
  return max(1, x.shape[0] * g.shape[0] // ALL_EXPERTS)


def default_block_rows(x, g, w) -> int:
  """The rows per work item ``moe_experts`` would pick for this call (``expected_rows``, the format)."""
  return moe.default_block_rows(g.shape[0], expected_rows(x, g), is_int4=isinstance(w, moe.Int4Experts))


def default_tiles(x, g, w):
  """The tiles ``moe_experts`` would pick for this call (from its expected rows and rows per item)."""
  return moe.default_tiles(w, expected_rows(x, g), default_block_rows(x, g, w))


IMPLS = {
    "pallas": lambda x, g, w: moe.moe_experts(x, g, w, expected_rows=expected_rows(x, g)),
    # The two INT4 forms forced (the default picks one by the expected programs per SM).
    "pallas_registers": lambda x, g, w: moe.moe_experts(x, g, w, expected_rows=expected_rows(x, g),
                                                        int4_dequant="registers"),
    "pallas_serial": lambda x, g, w: moe.moe_experts(x, g, w, expected_rows=expected_rows(x, g),
                                                     int4_dequant="registers_serial"),
    # The other launch order of the kernels' programs (``moe.KernelTiles.grid_order``).
    "pallas_item_minor": lambda x, g, w: moe.moe_experts(
        x, g, w, expected_rows=expected_rows(x, g), tiles=dataclasses.replace(default_tiles(x, g, w),
                                                                              grid_order="item_minor")),
    # The sorted rows' experts given (``moe.work_list_from_rows`` where A <= E, else the rows'
    # columns): its "g" is (group_sizes, sorted expert ids), ids the model's sort has (``with_row_ids``).
    "pallas_rows": lambda x, g, w: moe.moe_experts(x, g[0], w, expected_rows=expected_rows(x, g[0]),
                                                   sorted_expert_ids=g[1]),
    # Per-row items off (``per_row=False``) where they are the default (A <= 8): the sorted work
    # list the call took before.
    "pallas_sorted": lambda x, g, w: moe.moe_experts(x, g, w, expected_rows=expected_rows(x, g), per_row=False),
    "pallas_rows_sorted": lambda x, g, w: moe.moe_experts(x, g[0], w, expected_rows=expected_rows(x, g[0]),
                                                          sorted_expert_ids=g[1], per_row=False),
    "ragged_dot": lambda x, g, w: kimi.routed_experts(x, g, *w),
    "ragged_dot_mgpu": ragged_dot_mgpu_layer,
    # The model's routed block (``BLOCK_IMPLS``): its "x" is the tokens, its "g" (ids, weights).
    "block_pallas": lambda x, g, w: kimi.routed_block(x, g[0], g[1], w, "pallas"),
    "block_ragged_dot": lambda x, g, w: kimi.routed_block(x, g[0], g[1], w, "xla"),
    "block_pallas_sorted": lambda x, g, w: kimi.routed_block(x, g[0], g[1], w, "pallas", per_row=False),
}


ROW_ID_IMPLS = ("pallas_rows", "pallas_rows_sorted")
# Per-pair items against the sorted path, where per-pair items are the default (one token).
PER_ROW_PAIRS = (("pallas", "pallas_sorted"), ("pallas_rows", "pallas_rows_sorted"),
                 ("block_pallas", "block_pallas_sorted"))
# The model's whole routed block (``models.kimi.routed_block``: sort by expert, bincount, gather the
# rows, the experts, weight and add each token's rows back), from tokens [T, H] and the routing
# (ids [T, 8], weights [T, 8]): all the glue a model layer pays around the experts.
BLOCK_IMPLS = ("block_pallas", "block_ragged_dot", "block_pallas_sorted")


def block_inputs(impl, sets, seed):
  """The routings as ``impl`` takes them: for ``BLOCK_IMPLS``, T token rows and the routing (ids,
  softmax-like weights), the same experts as the sorted-rows cells."""
  if impl not in BLOCK_IMPLS:
    return sets
  rng = np.random.default_rng(seed)
  out = []
  for x, g, touched, ids in sets:
    tokens = jnp.asarray(rng.standard_normal((ids.shape[0], HIDDEN)), jnp.bfloat16)
    weights = rng.random(ids.shape).astype(np.float32)
    out.append((tokens, (jnp.asarray(ids), jnp.asarray(weights / weights.sum(1, keepdims=True))), touched, ids))
  return out


def with_row_ids(impl, sets):
  """The routings as ``impl`` takes them: for ``ROW_ID_IMPLS`` each group_sizes paired with the
  sorted rows' experts (E for padding rows), built here outside the timed step (the model would
  take them from its sort: ``flat_ids[order]``, one gather of A ints)."""
  if impl not in ROW_ID_IMPLS:
    return sets
  out = []
  for x, g, touched, _ in sets:
    sizes = np.asarray(g)
    ids = np.concatenate([np.repeat(np.arange(len(sizes)), sizes),
                          np.full(x.shape[0] - int(sizes.sum()), len(sizes))]).astype(np.int32)
    out.append((x, (g, jnp.asarray(ids)), touched, None))
  return out


def cell_inputs(data, impl, e, t):
  """The routings of cell (E, T) in the form ``impl`` takes (cached: lowering and timing must see
  the same arrays, and the block cells' tokens are drawn once)."""
  key = (e, t, "rows" if impl in ROW_ID_IMPLS else "block" if impl in BLOCK_IMPLS else None)
  if key not in data:
    data[key] = block_inputs(impl, with_row_ids(impl, data[(e, t)]), seed=1000 * e + t + 1)
  return data[key]


def weight_bytes(fmt, experts_touched):
  per_weight = 2.0 if fmt == "bf16" else 0.5 + 2.0 / 32
  return experts_touched * 3 * HIDDEN * INTER * per_weight


def reference_checks(compiled, data, weights, summary_cell=None) -> dict:
  """Correctness at K2.6 size: the bf16 kernel against ragged_dot on the same weights in every
  (E, T) where both were compiled, or against ragged_dot_mgpu where only that was (prefill-sized
  T, where ragged_dot takes seconds a call); relative L2 over the routed rows of each cell's first
  routing. The summary keys the markdown reports come from ``summary_cell`` (E, T) where it was
  checked against ragged_dot, else from the first cell that was."""
  check = {}
  for (e, t, fmt, impl), fn in compiled.items():
    refs = [r for r in ("ragged_dot", "ragged_dot_mgpu")
            if (e, t, "bf16", r) in compiled and not isinstance(compiled[(e, t, "bf16", r)], Exception)]
    if impl != "pallas" or fmt != "bf16" or isinstance(fn, Exception) or not refs:
      continue
    try:
      sets = data[(e, t)]
      xs, gs = [s[0] for s in sets], [s[1] for s in sets]
      got = np.asarray(fn(xs, gs, weights[("bf16", e)])[0].astype(jnp.float32))
      want = np.asarray(compiled[(e, t, "bf16", refs[0])](xs, gs, weights[("bf16", e)])[0].astype(jnp.float32))
      rows = int(np.asarray(gs[0]).sum())
      rel = float(np.linalg.norm(got[:rows] - want[:rows]) / np.linalg.norm(want[:rows]))
      check[f"pallas bf16 E={e} T={t} rel L2 vs {refs[0]}"] = rel
      if refs[0] == "ragged_dot" and ("rel_l2_vs_ragged_dot" not in check or (e, t) == summary_cell):
        check.update({"experts": e, "tokens": t, "rel_l2_vs_ragged_dot": rel})
    except Exception as err:
      check[f"pallas bf16 E={e} T={t}"] = f"{type(err).__name__}: {str(err)[:300]}"
  return check


def run(args, out: Path):
  t_start = time.perf_counter()
  dev = jax.devices()[0]
  weights = {}
  for e in args.experts:
    weights[("bf16", e)] = make_bf16(jax.random.key(e), e)
    weights[("int4", e)] = make_int4(jax.random.key(e + 1), e)
  jax.block_until_ready(weights)
  cells = []  # (E, T, fmt, impl)
  for e in args.experts:
    for t in args.tokens:
      for fmt, impl in (("bf16", "pallas"), ("int4", "pallas"), ("bf16", "pallas_item_minor"),
                        ("int4", "pallas_item_minor"), ("bf16", "pallas_rows"), ("int4", "pallas_rows"),
                        ("bf16", "pallas_sorted"), ("int4", "pallas_sorted"),
                        ("bf16", "pallas_rows_sorted"), ("int4", "pallas_rows_sorted"),
                        ("bf16", "ragged_dot"), ("bf16", "ragged_dot_mgpu")):
        mgpu_here = e != args.experts[0] or not args.mgpu_tokens or t in args.mgpu_tokens
        if impl in ROW_ID_IMPLS and TOP_K * t > e and (impl != "pallas_rows" or t not in args.rows_tokens
                                                       or moe.default_work_list_impl(e) != "jnp"):
          continue  # past A = E the ids give the jnp list's row columns only: timed where asked
        if impl in ("pallas_sorted", "pallas_rows_sorted") and TOP_K * t > moe.PER_ROW_MAX_ROWS:
          continue  # elsewhere the same as "pallas_rows"
        if impl in args.impls and fmt in args.formats and (impl != "ragged_dot_mgpu" or mgpu_here):
          cells.append((e, t, fmt, impl))
      # The model has no expert-parallel path yet (its block runs all E experts with the default
      # expected_rows), so the block is timed where that is the configuration: all 384 experts.
      for fmt, impl in (("bf16", "block_pallas"), ("int4", "block_pallas"), ("bf16", "block_ragged_dot"),
                        ("bf16", "block_pallas_sorted"), ("int4", "block_pallas_sorted")):
        if impl == "block_pallas_sorted" and TOP_K * t > moe.PER_ROW_MAX_ROWS:
          continue  # elsewhere the same as "block_pallas"
        if impl in args.impls and fmt in args.formats and t in args.block_tokens and e == ALL_EXPERTS:
          cells.append((e, t, fmt, impl))
      for variant in ("pallas_registers", "pallas_serial"):
        if variant in args.impls and "int4" in args.formats and t in args.variant_tokens:
          cells.append((e, t, "int4", variant))
  data = {(e, t): routings(t, e, seed=1000 * e + t) for e in args.experts for t in args.tokens}

  def lower(cell):
    e, t, fmt, impl = cell
    sets = cell_inputs(data, impl, e, t)
    return in_step(IMPLS[impl]).lower([s[0] for s in sets], [s[1] for s in sets], weights[(fmt, e)])

  compiled = compile_cells(cells, lower, args.compile_threads, serial=lambda cell: cell[3] in ("ragged_dot", "block_ragged_dot"))
  print(f"compiled {len(cells)} cells in {time.perf_counter() - t_start:.0f} s", flush=True)
  if args.wait_for:  # let another job on this GPU finish before timing
    while not Path(args.wait_for).exists() and time.perf_counter() - t_start < args.wait_max_s:
      time.sleep(1)
  t_timing = time.perf_counter()
  caps = ceilings()
  stream = caps["stream_read_bytes_per_s"]
  print(f"stream {stream / 1e12:.2f} TB/s, copy {caps['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"matmul {caps['matmul_bf16_flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)

  # The summary at the cell the earlier runs reported (the first expert count, the third T).
  check = reference_checks(compiled, data, weights, (args.experts[0], args.tokens[min(2, len(args.tokens) - 1)]))
  # The work list from row ids must give exactly the default's output (the same list).
  for (e, t, fmt, impl), fn in compiled.items():
    default = compiled.get((e, t, fmt, "pallas"))
    if impl not in ROW_ID_IMPLS or isinstance(fn, Exception) or default is None or isinstance(default, Exception):
      continue
    try:
      sets = data[(e, t)]
      a = fn(*[[s[i] for s in cell_inputs(data, impl, e, t)] for i in (0, 1)], weights[(fmt, e)])
      b = default([s[0] for s in sets], [s[1] for s in sets], weights[(fmt, e)])
      check[f"{impl} {fmt} E={e} T={t} bit-identical to pallas"] = all(
          bool(jnp.array_equal(x, y)) for x, y in zip(a, b))
    except Exception as err:
      check[f"{impl} {fmt} E={e} T={t}"] = f"{type(err).__name__}: {str(err)[:200]}"
  # The model's routed block: the kernel path against the ragged_dot path on the same bf16 weights.
  for (e, t, fmt, impl), fn in compiled.items():
    want = compiled.get((e, t, fmt, "block_ragged_dot"))
    if impl != "block_pallas" or fmt != "bf16" or isinstance(fn, Exception) or want is None or isinstance(want, Exception):
      continue
    try:
      sets = cell_inputs(data, impl, e, t)
      args_ = ([s[0] for s in sets], [s[1] for s in sets], weights[(fmt, e)])
      got = np.stack([np.asarray(y[0]) for y in fn(*args_)])
      ref = np.stack([np.asarray(y[0]) for y in want(*args_)])
      check[f"block_pallas bf16 E={e} T={t} rel L2 vs block_ragged_dot"] = float(
          np.linalg.norm(got - ref) / np.linalg.norm(ref))
    except Exception as err:
      check[f"block_pallas bf16 E={e} T={t}"] = f"{type(err).__name__}: {str(err)[:200]}"
  # Per-pair items must give exactly the sorted path's output.
  for (e, t, fmt, impl), fn in compiled.items():
    other = dict(PER_ROW_PAIRS).get(impl)
    base = compiled.get((e, t, fmt, other))
    if other is None or isinstance(fn, Exception) or base is None or isinstance(base, Exception):
      continue
    try:
      args_ = [[s[i] for s in cell_inputs(data, impl, e, t)] for i in (0, 1)] + [weights[(fmt, e)]]
      check[f"per-row {impl} {fmt} E={e} T={t} bit-identical to {other}"] = all(
          bool(jnp.array_equal(x, y)) for a, b in zip(fn(*args_), base(*args_))
          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    except Exception as err:
      check[f"per-row {impl} {fmt} E={e} T={t}"] = f"{type(err).__name__}: {str(err)[:200]}"
  print(f"check: {check}", flush=True)

  rows_out = []
  for cell in cells:
    e, t, fmt, impl = cell
    row = {"experts": e, "tokens": t, "format": fmt, "impl": impl}
    fn = compiled[cell]
    sets = cell_inputs(data, impl, e, t)
    touched = statistics.mean(s[2] for s in sets)
    row["distinct_experts"] = touched
    row["roofline_us"] = weight_bytes(fmt, touched) / stream * 1e6
    if isinstance(fn, Exception):
      row["error"] = f"{type(fn).__name__}: {str(fn)[:300]}"
    elif time.perf_counter() - t_timing > args.time_budget_s:
      row["error"] = "skipped: benchmark deadline"
    else:
      try:
        w = weights[(fmt, e)]
        seconds = timed_in_step(fn, sets, w)
        row["time_us"] = seconds * 1e6
        row["roofline_fraction"] = row["roofline_us"] / row["time_us"]
        try:
          row["device_us"], row["device_kernels_us"] = device_in_step(fn, sets, w)
          row["device_roofline_fraction"] = row["roofline_us"] / row["device_us"]
        except Exception as err:  # the wall time stands; say why the GPU time is missing
          row["device_error"] = f"{type(err).__name__}: {str(err)[:300]}"
      except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    print(json.dumps(row), flush=True)
    rows_out.append(row)

  result = {"device": str(dev), "device_kind": dev.device_kind, "jax": jax.__version__,
            "python": platform.python_version(), "argv": sys.argv[1:], "ceilings": caps,
            "check": check, "hidden": HIDDEN, "intermediate": INTER, "top_k": TOP_K,
            "routings_per_cell": ROUTINGS, "rows": rows_out,
            "wall_s": time.perf_counter() - t_start}
  if args.resume:
    resume(result, json.loads(args.resume.read_text()))
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
  (out / f"{args.stem}.md").write_text(markdown(result))
  print(markdown(result))


def resume(result, earlier):
  """Adds ``earlier``'s rows for the cells this run did not time (or timed only to an error,
  which then gives way to an earlier timing), marked with their run (1 + the run they carry), and
  its runs' ceilings and commands under ``earlier_runs``: each row's fraction is against the
  ceilings of the run that timed it."""
  def key(r):
    return r["experts"], r["tokens"], r["format"], r["impl"]

  mine = {key(r): r for r in result["rows"]}
  earlier_timed = {key(r) for r in earlier["rows"] if "error" not in r}
  # A cell this run could not time (deadline, compile error) keeps the earlier run's timing.
  result["rows"] = [r for r in result["rows"] if "error" not in r or key(r) not in earlier_timed]
  for r in earlier["rows"]:
    if key(r) not in mine or ("error" in mine[key(r)] and "error" not in r):
      result["rows"].append({**r, "run": 1 + r.get("run", 0)})
  result["earlier_runs"] = [{k: earlier[k] for k in ("argv", "ceilings", "check")}] + earlier.get("earlier_runs", [])


def markdown(result) -> str:
  caps = result["ceilings"]
  lines = [
      "# One K2.6 MoE layer, routed experts (gate, up, down), random top-8 routing",
      "",
      f"{result['device_kind']}, jax {result['jax']}. Read-only stream {caps['stream_read_bytes_per_s'] / 1e12:.2f} TB/s, "
      f"copy {caps['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), bf16 matmul "
      f"{caps['matmul_bf16_flop_per_s'] / 1e12:.0f} TFLOP/s, measured in the same run.",
      "Roofline = bytes of the touched experts' weights (bf16: 2 B/weight; INT4: 0.5 B + a bf16 scale "
      "per 32) / read-only stream bandwidth. Times: us per layer call, median of 5 steps of 16 calls in one "
      "executable (see the script). GPU: the call's kernels summed (CUPTI), the fraction of the roofline beside it; "
      "wall: the step's wall time per call (host-side dispatch and CUDA-graph launch included), its fraction in "
      "parentheses.",
      "",
  ]
  for i, run_ in enumerate(result.get("earlier_runs", []), start=1):
    cells = sorted({(r["experts"], r["impl"]) for r in result["rows"] if r.get("run", 0) == i}, reverse=True)
    if not cells:
      continue
    caps_ = run_["ceilings"]
    lines += [f"Run {i} (an earlier run; its cells kept where this run did not time them: "
              + ", ".join(f"E={e} {impl}" for e, impl in cells)
              + f"): stream {caps_['stream_read_bytes_per_s'] / 1e12:.2f} TB/s, its fractions against it; "
              f"`PYTHONPATH=. python3 benchmarks/bench_moe.py {' '.join(run_['argv'])}`.", ""]
  by = {(r["experts"], r["tokens"], r["format"], r["impl"]): r for r in result["rows"]}

  def gpu(r):
    return f"{r['device_us']:.0f}" if r and "device_us" in r else ("error" if r and "error" in r else "-")

  def frac(r):
    return f"{r['device_roofline_fraction']:.0%}" if r and "device_roofline_fraction" in r else "-"

  def speedup(slow, fast):
    """GPU time of ``slow`` over ``fast``, or "-" where either is missing; marked where the two
    times come from different runs (cells resumed from earlier calls)."""
    timed = slow and fast and "device_us" in slow and "device_us" in fast
    if not timed:
      return "-"
    runs = (slow.get("run", 0), fast.get("run", 0))
    return f"{slow['device_us'] / fast['device_us']:.1f}x" + ("" if runs[0] == runs[1] else f" (runs {runs[0]}/{runs[1]})")

  def wall(r):
    return f"{r['time_us']:.0f} ({r['roofline_fraction']:.0%})" if r and "time_us" in r else "-"

  for e in sorted({r["experts"] for r in result["rows"] if r["impl"] not in BLOCK_IMPLS}, reverse=True):
    lines += [f"## {e} experts", "",
              "| T | distinct experts | bf16 roofline | pallas bf16 GPU | of roofline | wall | INT4 roofline "
              "| pallas INT4 GPU | of roofline | wall | ragged_dot bf16 GPU | ragged_dot_mgpu bf16 GPU "
              "| ragged_dot / pallas bf16 |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in sorted({r["tokens"] for r in result["rows"] if r["experts"] == e}):
      pb, pi, rd, mg = (by.get((e, t, f, i)) for f, i in (("bf16", "pallas"), ("int4", "pallas"),
                                                         ("bf16", "ragged_dot"), ("bf16", "ragged_dot_mgpu")))
      ref = pb or pi or rd or mg
      if ref is None:  # only block cells at this T
        continue
      speed = speedup(rd, pb)
      lines.append(
          f"| {t} | {ref['distinct_experts']:.1f} | {pb['roofline_us'] if pb else 0:.0f} | {gpu(pb)} | {frac(pb)} "
          f"| {wall(pb)} | {pi['roofline_us'] if pi else 0:.0f} | {gpu(pi)} | {frac(pi)} | {wall(pi)} "
          f"| {gpu(rd)} | {gpu(mg)} | {speed} |")
    lines.append("")
  for e in sorted({r["experts"] for r in result["rows"] if r["impl"] in BLOCK_IMPLS}, reverse=True):
    lines += [f"## The model's routed block, {e} experts", "",
              "`models.kimi.routed_block` from tokens and routing: sort by expert, gather the rows, the experts, "
              "weight and add each token's rows back (on the GPU a gather-add, `gather_add_rows`); at T = 1 per-pair "
              "items without the sort. *experts alone*: the call the model makes inside "
              "it (`pallas_rows` where 8T <= E, else `pallas`) from the table above.", "",
              "| T | distinct experts | pallas bf16 block GPU | of roofline | experts alone | pallas INT4 block GPU "
              "| of roofline | experts alone | ragged_dot bf16 block GPU | ragged_dot / pallas (bf16 blocks) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in sorted({r["tokens"] for r in result["rows"] if r["experts"] == e and r["impl"] in BLOCK_IMPLS}):
      pb, pi, rd = (by.get((e, t, f, i)) for f, i in (("bf16", "block_pallas"), ("int4", "block_pallas"),
                                                     ("bf16", "block_ragged_dot")))
      alone = {f: next((r for r in (by.get((e, t, f, "pallas_rows")), by.get((e, t, f, "pallas")))
                        if r and "device_us" in r), None) for f in ("bf16", "int4")}
      ref = pb or pi or rd
      if ref is None:  # only block cells at this T
        continue
      speed = speedup(rd, pb)
      lines.append(f"| {t} | {ref['distinct_experts']:.1f} | {gpu(pb)} | {frac(pb)} | {gpu(alone['bf16'])} "
                   f"| {gpu(pi)} | {frac(pi)} | {gpu(alone['int4'])} | {gpu(rd)} | {speed} |")
    lines.append("")
  lines += ["GPU time per call by kernel kind (us; INT4 pallas):", ""]
  for r in result["rows"]:
    if r["format"] == "int4" and r["impl"] != "pallas_item_minor" and "device_kernels_us" in r and (
        r["impl"].startswith(("pallas", "block_pallas"))):
      kinds = ", ".join(f"{k} {v:.1f}" for k, v in list(r["device_kernels_us"].items())[:6])
      label = {"pallas": "", "block_pallas": " (routed block)"}.get(r["impl"], f" ({r['impl']})")
      lines.append(f"- E={r['experts']} T={r['tokens']}{label}: {kinds}")
  lines.append("")
  errors = [r for r in result["rows"] if "error" in r or "device_error" in r]
  if errors:
    lines += ["Errors / skipped cells:", ""]
    lines += [f"- E={r['experts']} T={r['tokens']} {r['format']} {r['impl']}: {r.get('error') or r['device_error']}"
              for r in errors]
    lines.append("")
  # Each kind of check from the newest run that made it (a run that times only some impls
  # cannot check the others), with its run number where that is an earlier run.
  checks = [result.get("check", {})] + [r.get("check", {}) for r in result.get("earlier_runs", [])]

  def newest(keep):
    """(the newest run's checks that ``keep`` selects, that run's label: '' for this run)."""
    for i, check in enumerate(checks):
      picked = {k: v for k, v in check.items() if keep(k)}
      if picked:
        return picked, f" (run {i})" if i else ""
    return {}, ""

  k26, run_k26 = newest(lambda k: k in ("experts", "tokens", "rel_l2_vs_ragged_dot"))
  if "rel_l2_vs_ragged_dot" in k26:
    lines.append(f"Check at K2.6 size{run_k26}: pallas bf16 vs ragged_dot relative L2 {k26['rel_l2_vs_ragged_dot']:.1e} "
                 f"({k26['experts']} experts, T = {k26['tokens']}).")
  cell_checks, run_cells = newest(lambda k: k.startswith("pallas bf16 E="))
  if cell_checks:
    lines.append(f"pallas bf16 against the reference compiled for the same cell, same weights{run_cells}: "
                 + "; ".join(f"{k[len('pallas bf16 '):]}" + (f" {v:.1e}" if isinstance(v, float) else f": {v}")
                             for k, v in cell_checks.items()) + ".")
  block_checks, run_block = newest(lambda k: k.startswith("block_pallas"))
  if block_checks:
    lines.append(f"Routed block, kernel path against the ragged_dot path on the same bf16 weights{run_block}: "
                 + "; ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k}: {v}" for k, v in block_checks.items())
                 + ".")
  per_row_checks, run_per_row = newest(lambda k: k.startswith("per-row"))
  if per_row_checks:
    lines.append(f"Per-pair items against the sorted path, same routings{run_per_row}: "
                 + "; ".join(f"{k[len('per-row '):]}: {v}" for k, v in per_row_checks.items()) + ".")
  pairs = [(r, by.get((r["experts"], r["tokens"], r["format"], other))) for impl, other in PER_ROW_PAIRS
           for r in result["rows"] if r["impl"] == impl and "device_us" in r]
  pairs = [(r, d) for r, d in pairs if d and "device_us" in d and d.get("run", 0) == r.get("run", 0)]
  if pairs:
    lines.append("Per-pair items (one item per (token, slot), no sort or work list; the default at one token) "
                 "against the sorted path, same run (GPU us, of roofline): " + ", ".join(
                     f"{r['impl']} {r['format']} E={r['experts']} T={r['tokens']} {r['device_us']:.1f} "
                     f"({r['device_roofline_fraction']:.0%}) vs {d['device_us']:.1f} "
                     f"({d['device_roofline_fraction']:.0%}), {r['device_us'] / d['device_us']:.2f}x" for r, d in pairs) + ".")
  row_id_checks, run_rows = newest(lambda k: k.startswith(ROW_ID_IMPLS))
  if row_id_checks:
    lines.append(f"Work list from row ids against the default, same routings{run_rows}: "
                 + "; ".join(f"{k}: {v}" for k, v in row_id_checks.items()) + ".")
  for fmt in ("bf16", "int4"):
    pairs = [(r, by.get((r["experts"], r["tokens"], fmt, "pallas"))) for r in result["rows"]
             if r["impl"] == "pallas_item_minor" and r["format"] == fmt and "device_us" in r]
    if pairs:
      lines.append(f"{fmt} with `grid_order=\"item_minor\"` (GPU us, and against the default): " + ", ".join(
          f"E={r['experts']} T={r['tokens']} {r['device_us']:.0f}"
          + (f" ({r['device_us'] / d['device_us']:.2f}x)" if d and "device_us" in d else "") for r, d in pairs) + ".")
  for fmt in ("bf16", "int4"):
    pairs = [(r, by.get((r["experts"], r["tokens"], fmt, "pallas"))) for r in result["rows"]
             if r["impl"] == "pallas_rows" and r["format"] == fmt and "device_us" in r]
    if pairs:
      lines.append(f"{fmt} with the work list from the sorted rows' experts (`pallas_rows`; past 8T = E the "
                   f"counts give the items and the ids the rows' columns; "
                   f"GPU us, of roofline, and against the default): " + ", ".join(
                       f"E={r['experts']} T={r['tokens']} {r['device_us']:.0f} ({r['device_roofline_fraction']:.0%}"
                       + (f", {r['device_us'] / d['device_us']:.2f}x" if d and "device_us" in d else "") + ")"
                       for r, d in pairs) + ".")
  for impl, what in (("pallas_registers", "with both weights' MMAs in flight"),
                     ("pallas_serial", "draining the MMAs after each weight's tile")):
    rows = [r for r in result["rows"] if r["impl"] == impl and "time_us" in r]
    if rows:
      lines.append(f"INT4 {what} ({impl}): " + ", ".join(
          f"E={r['experts']} T={r['tokens']} GPU {r.get('device_us', float('nan')):.0f} us "
          f"({r.get('device_roofline_fraction', float('nan')):.0%}), wall {r['time_us']:.0f} us" for r in rows) + ".")
  lines.append(f"Command: `PYTHONPATH=. python3 benchmarks/bench_moe.py {' '.join(result['argv'])}`")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  parser.add_argument("--stem", default="bench_moe", help="output files STEM.json and STEM.md")
  parser.add_argument("--experts", type=int, nargs="+", default=[ALL_EXPERTS, 48])
  parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
  parser.add_argument("--impls", nargs="+", default=list(IMPLS))
  parser.add_argument("--formats", nargs="+", default=["bf16", "int4"], choices=["bf16", "int4"])
  parser.add_argument("--compile-threads", type=int, default=8)
  parser.add_argument("--variant-tokens", type=int, nargs="*", default=[1, 17, 136],
                      help="T at which to also time both INT4 forms forced (pallas_registers, pallas_serial)")
  parser.add_argument("--mgpu-tokens", type=int, nargs="*", default=[],
                      help="T at which to time ragged_dot_mgpu for the first expert count (default all); "
                           "its 384-group kernel takes about 6 s to lower per T")
  parser.add_argument("--rows-tokens", type=int, nargs="*", default=[],
                      help="T past E / 8 at which to also time pallas_rows (there the ids replace the work "
                           "list's [A, E] pass for the rows' columns; it matters at prefill sizes)")
  parser.add_argument("--block-tokens", type=int, nargs="*", default=[1, 9, 17, 136],
                      help="T at which to time the model's routed block (block_pallas, block_ragged_dot; "
                           "at 384 experts only)")
  parser.add_argument("--resume", type=Path, default=None,
                      help="an earlier run's bench_moe.json: its rows for cells this run does not time are kept")
  parser.add_argument("--time-budget-s", type=float, default=120.0, help="skip timing cells past this")
  parser.add_argument("--wait-for", default="", help="before timing, wait until this file exists")
  parser.add_argument("--wait-max-s", type=float, default=400.0)
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("bench_moe.py needs a CUDA GPU")
  run(args, args.out)


if __name__ == "__main__":
  main()
