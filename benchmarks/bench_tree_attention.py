"""Tree-verify attention on the GPU: the Mosaic GPU kernel against its roofline and the plain-jnp reference.

    PYTHONPATH=. python3 benchmarks/bench_tree_attention.py --out benchmarks/results   # on the GPU

Kimi's per-GPU shape under tensor parallelism: absorbed MLA, R=512 latent + P=64 rope, bf16 cache,
heads {8, 64} x batch {1, 8, 32} x cached tokens {4k, 32k, 128k} x q_len {1, 9, 17, 33, 65}.

Per cell (DESIGN §4): bytes = (cached + q_len) * 1152 per request, flops = 2 * heads * q_len *
(576 + 512) per token and request; roofline time = max(bytes / stream_bw, flops / matmul_peak)
with a read-only stream (a sum over 4 GiB) and an 8192^3 bf16 matmul measured in the same run.
Times are medians of per-call GPU time from CUPTI (the sum of the call's kernels, launch gaps
excluded), over calls that rotate through enough request slots to keep the KV out of L2; the
kernel's own time (its merge epilogue and index prep excluded) is reported beside it.

Three times per cell (CUPTI, medians, the same calls):
  * ``time_us`` ("whole call"): ``mla_tree_attention(...)`` as one call: the window-metadata fusion
    (``_window_meta``), the attention kernel and the merge (by default one Mosaic GPU merge
    kernel; with ``Options(merge="pairwise")`` two XLA fusions);
  * ``layer_us`` ("per layer"): ``mla_tree_attention(..., window_meta=meta)`` with ``meta`` from
    ``prepare_mla_window`` built outside the timed call: the attention kernel and the merge. This
    is what each layer of the model pays, since ``KimiModel`` builds the metadata once per step
    for all its layers (``meta_us``, timed alone: one fusion of about 1 us, or with live
    splits, which batches of several requests run by default, about 8-10 us on the H200 for the
    few small kernels that pick the split counts);
  * ``kernel_us``: the attention kernel alone (the longest kernel of the whole call).
The reference's time is its whole call (it has no metadata to hoist); the speedup is given on
the whole-call basis (``speedup_vs_reference``) and on the per-layer basis
(``speedup_vs_reference_per_layer``).

Every cell's kernel output is checked against the reference (bf16 inputs, float32 math) where the
reference fits; the reference is timed there too. jax's own decode attention (Pallas Triton, the
one in ``jax.experimental.pallas.ops.gpu.decode_attention``) applies to q_len 1 only and is timed
on the 512-wide latent alone (its head dim must be a power of two: the rope part is left out, so
it moves 1024 of the 1152 bytes per token and is a lower bound on its cost for this problem).

Writes ``bench_tree_attention.json`` and ``.md`` (``.png`` with ``--plot``). Cells run in priority
order (the issue's goal cells first) until ``--budget-s`` runs out; skipped cells are listed.
``--resume FILE ...`` carries the cells of earlier result files over (each row keeps its run's
ceilings and is tagged with its run) and times only the cells they lack, so a grid too long for
one device call fills up over several; ``--render-only`` writes the combined files without a GPU.
The pool is sized for the longest ``--cached`` (or ``--pool-for``), and the launched split count
follows the pool's length: a run that times only the 4k cells must pass ``--pool-for 131072`` for
its cells to be comparable with the grid's.
``--variants`` then times kernel forms and probes side by side (``variant_list``: the transposed
kernel "rows_n" and the 64-row-tile kernel "rows_m" at each listed cell, and probes that leave
the loads, the compute or the P V products out);
each row's ``breakdown_us`` in the JSON lists every kernel of the call with its median time.
Each row's ``time_us`` is the whole call (index prep, kernel and merge) timed as one.
"""

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference
from pallas_kernels import tree_attention as ta

LATENT, ROPE = 512, 64
BYTES_PER_TOKEN = (LATENT + ROPE) * 2  # 1152
L2_BYTES = 60e6
SCALE = 1.0 / math.sqrt(192)


LAST_BREAKDOWN = []  # (kernel name, median ms) of the last cupti_times call, in launch order


def cupti_times(fn, arg_sets, warmup=1):
  """Per-call GPU time (ms, all kernels of the call summed) and the longest kernel's time."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
  ext = mosaic_gpu_lib._mosaic_gpu_ext
  for args in arg_sets[:warmup]:
    jax.block_until_ready(fn(*args))
  ext._cupti_init()
  try:
    outs = [fn(*args) for args in arg_sets]
    jax.block_until_ready(outs)
  finally:
    timings = ext._cupti_get_timings(True)
  per_call = len(timings) // len(arg_sets)
  if per_call == 0 or len(timings) % len(arg_sets):
    raise RuntimeError(f"{len(timings)} kernel timings for {len(arg_sets)} calls")
  calls = [timings[i * per_call:(i + 1) * per_call] for i in range(len(arg_sets))]
  total = [sum(t for _, t in c) for c in calls]
  longest = [max(t for _, t in c) for c in calls]
  LAST_BREAKDOWN[:] = [(calls[0][k][0], statistics.median(c[k][1] for c in calls))
                       for k in range(per_call)]
  return statistics.median(total), statistics.median(longest), per_call


def wall_times(fn, arg_sets):
  """Fallback when CUPTI is unavailable: dispatch all calls, then block (ms per call)."""
  jax.block_until_ready(fn(*arg_sets[0]))
  start = time.perf_counter()
  jax.block_until_ready([fn(*args) for args in arg_sets])
  ms = (time.perf_counter() - start) * 1e3 / len(arg_sets)
  return ms, ms, None


def timed(fn, arg_sets):
  try:
    return cupti_times(fn, arg_sets) + ("cupti",)
  except Exception as e:  # noqa: BLE001 - fall back and say so in the results
    print(f"  cupti failed ({type(e).__name__}: {e}); wall clock instead", flush=True)
    return wall_times(fn, arg_sets) + ("wall",)


def ceilings():
  """Read-only stream bandwidth (bytes/s) and bf16 matmul rate (flop/s) on this GPU, now."""
  x = jax.random.normal(jax.random.key(0), (1 << 31,), jnp.bfloat16)  # 4 GiB
  stream = jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32))
  ms, _, _, _ = timed(stream, [(x,)] * 10)
  bandwidth = x.size * 2 / (ms * 1e-3)
  del x
  a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
  mm = jax.jit(lambda p, q: p @ q)
  ms, _, _, _ = timed(mm, [(a, b)] * 10)
  peak = 2 * 8192**3 / (ms * 1e-3)
  return bandwidth, peak


def make_pool(batch, cache_len, rotations, key):
  """bf16 pools with ``batch * rotations`` slots of ``cache_len`` tokens (random, not zeros)."""
  slots = batch * rotations
  k1, k2 = jax.random.split(key)
  c_kv = jax.random.normal(k1, (slots, cache_len, LATENT), jnp.bfloat16)
  k_pe = jax.random.normal(k2, (slots, cache_len, ROPE), jnp.bfloat16)
  return c_kv, k_pe


def window(batch, q_len, cached, key, mixed=False):
  """A random tree per request (chain-heavy, like DDTree output) with a few padded rows; every
  request ``cached`` long, or with ``mixed`` lengths from cached / 32 up to cached (geometric)."""
  rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 1 << 30)))
  parents = np.full((batch, q_len), -1, np.int32)
  for i in range(1, q_len):
    parents[:, i] = rng.integers(max(0, i - 3), i, size=batch)
  valid = np.ones((batch, q_len), bool)
  if q_len > 2:
    valid[:, -1] = False  # one padded row per request
  from ddtree_jax.tree import visibility_from_parents
  visibility = visibility_from_parents(jnp.asarray(parents), jnp.asarray(valid))
  prefix = jnp.full((batch,), cached, jnp.int32)
  if mixed:
    prefix = jnp.asarray(np.round(cached * np.exp2(-np.linspace(5, 0, batch))), jnp.int32)
  return prefix, visibility, jnp.asarray(valid)


def cell_metrics(heads, batch, cached, q_len, seconds, bandwidth, peak, prefix=None):
  """Bytes, FLOPs and the roofline of a cell; ``prefix``: each request's cached length where
  they differ (default: all ``cached``)."""
  tokens = batch * (cached + q_len) if prefix is None else int(np.sum(np.asarray(prefix) + q_len))
  bytes_moved = tokens * BYTES_PER_TOKEN
  flops = 2 * heads * q_len * (LATENT + ROPE + LATENT) * tokens
  roof = max(bytes_moved / bandwidth, flops / peak)
  return dict(bytes=bytes_moved, flops=flops, roofline_us=roof * 1e6,
              bytes_per_s=bytes_moved / seconds, flops_per_s=flops / seconds,
              roofline_fraction=roof / seconds)


def reference_fits(heads, batch, cached, q_len):
  t = cached + q_len
  need = batch * t * (LATENT + ROPE) * 4 * 2 + batch * heads * q_len * t * 4 * 4
  return need < 60e9


def run_cell(heads, batch, cached, q_len, pool, bandwidth, peak, args, num_splits=None,
             partial_dtype="auto", check=True, rows_per_tile=None, options=None,
             time_reference=True, mixed=False):
  c_kv, k_pe = pool
  rotations = c_kv.shape[0] // batch
  key = jax.random.key(heads * 1000003 + batch * 101 + cached + q_len)
  kq, kr, kw = jax.random.split(key, 3)
  q_lat = jax.random.normal(kq, (batch, q_len, heads, LATENT), jnp.bfloat16)
  q_rope = jax.random.normal(kr, (batch, q_len, heads, ROPE), jnp.bfloat16)
  prefix, visibility, valid = window(batch, q_len, cached, kw, mixed=mixed)
  lengths = prefix if mixed else None
  slot_sets = [jnp.arange(r * batch, (r + 1) * batch, dtype=jnp.int32) for r in range(rotations)]
  est = cell_metrics(heads, batch, cached, q_len, 1.0, bandwidth, peak, lengths)["roofline_us"] * 1e-6
  calls = int(min(max(args.min_calls, 0.15 / max(est * 3, 1e-6)), args.max_calls))
  arg_sets = [(q_lat, q_rope, c_kv, k_pe, slot_sets[i % rotations], prefix, visibility, valid)
              for i in range(calls)]
  kernel = jax.jit(functools.partial(ta.mla_tree_attention, scale=SCALE, num_splits=num_splits,
                                     partial_dtype=partial_dtype, rows_per_tile=rows_per_tile,
                                     options=options))
  t0 = time.perf_counter()
  out = jax.block_until_ready(kernel(*arg_sets[0]))
  compile_s = time.perf_counter() - t0
  total_ms, kernel_ms, kernels, how = timed(kernel, arg_sets)
  breakdown = [(name, round(ms * 1e3, 2)) for name, ms in LAST_BREAKDOWN]
  # Per layer: the window metadata built once outside the timed call (one meta per slot set).
  prepare = jax.jit(functools.partial(
      ta.prepare_mla_window, heads=heads, latent_dim=LATENT, rope_dim=ROPE,
      cache_len=c_kv.shape[1], num_splits=num_splits, partial_dtype=partial_dtype,
      rows_per_tile=rows_per_tile, options=options))
  metas = [prepare(slot_sets[r], prefix, visibility, valid) for r in range(rotations)]
  meta_ms, _, _, _ = timed(prepare, [(slot_sets[i % rotations], prefix, visibility, valid)
                                     for i in range(min(calls, 20))])
  layer = jax.jit(lambda *a: ta.mla_tree_attention(
      *a[:8], scale=SCALE, num_splits=num_splits, partial_dtype=partial_dtype,
      rows_per_tile=rows_per_tile, options=options, window_meta=a[8]))
  layer_sets = [a + (metas[i % rotations],) for i, a in enumerate(arg_sets)]
  layer_out = layer(*layer_sets[0])
  layer_ms, _, layer_kernels, _ = timed(layer, layer_sets)
  layer_breakdown = [(name, round(ms * 1e3, 2)) for name, ms in LAST_BREAKDOWN]
  row = dict(heads=heads, batch=batch, cached=cached, q_len=q_len, calls=calls,
             time_us=total_ms * 1e3, layer_us=layer_ms * 1e3, kernel_us=kernel_ms * 1e3,
             meta_us=meta_ms * 1e3, kernels_per_call=kernels,
             kernels_per_layer_call=layer_kernels,
             layer_equals_call=bool(jnp.array_equal(layer_out, out)),
             timer=how, compile_s=round(compile_s, 2), num_splits=num_splits,
             partial_dtype=partial_dtype, rows_per_tile_override=rows_per_tile,
             breakdown_us=breakdown, layer_breakdown_us=layer_breakdown)
  plan = ta.plan(q_len=q_len, heads_per_group=heads, num_work=batch, key_dims=(LATENT, ROPE),
                 value_dim=LATENT, shared_value=True, cache_len=c_kv.shape[1],
                 num_splits=num_splits, partial_dtype=partial_dtype, rows_per_tile=rows_per_tile,
                 options=options, query_dtype=jnp.bfloat16)
  row["options"] = str(plan.options)
  row["partials"] = plan.partial_dtype  # what "auto" became
  row.update(rows_per_tile=plan.rows_per_tile, row_tiles=plan.num_row_tiles,
             splits=plan.num_splits, value_wgs=plan.value_wgs)
  row.update(cell_metrics(heads, batch, cached, q_len, total_ms * 1e-3, bandwidth, peak, lengths))
  if mixed:
    row["cached_per_request"] = [int(n) for n in np.asarray(prefix)]
  row["kernel_only_roofline_fraction"] = row["roofline_us"] / row["kernel_us"]
  row["layer_roofline_fraction"] = row["roofline_us"] / row["layer_us"]
  if check and reference_fits(heads, batch, cached, q_len):
    # The reference reads every pool column: give it a pool of exactly cached + q_len columns.
    t_cols = cached + q_len
    small = (c_kv[:batch, :t_cols], k_pe[:batch, :t_cols])
    ref_slots = jnp.arange(batch, dtype=jnp.int32)
    ref = jax.jit(functools.partial(reference.mla_tree_attention, scale=SCALE))
    ref_args = (q_lat, q_rope, *small, ref_slots, prefix, visibility, valid)
    want = ref(*ref_args)
    got = kernel(q_lat, q_rope, c_kv, k_pe, ref_slots, prefix, visibility, valid)
    err = jnp.abs(got - want)
    row["max_abs_err"] = float(jnp.max(jnp.where(valid[:, :, None, None], err, 0)))
    row["finite"] = bool(jnp.isfinite(got).all())
    if time_reference:
      ref_calls = max(3, min(calls, 20))
      ref_ms, _, _, _ = timed(ref, [ref_args] * ref_calls)
      row["reference_us"] = ref_ms * 1e3
      row["speedup_vs_reference"] = ref_ms / total_ms
      row["speedup_vs_reference_per_layer"] = ref_ms / layer_ms
    del want, got, small
  if q_len == 1 and args.decode_attention and check:
    row.update(decode_attention(heads, batch, cached, c_kv, prefix))
  del out, layer_out, metas
  return row


def decode_attention(heads, batch, cached, c_kv, prefix):
  """jax's Pallas (Triton) decode attention on the 512-wide latent (rope omitted)."""
  try:
    import warnings
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      from jax.experimental.pallas.ops.gpu import decode_attention as da
    # Its grid splits the whole key length 16 ways: give it the cached columns rounded up to 4096.
    kv = c_kv[:batch, :-(-(cached + 1) // 4096) * 4096]
    q = jax.random.normal(jax.random.key(5), (batch, heads, LATENT), jnp.bfloat16)
    # block_k 32: its default tiles of 256 keys x 512 need more shared memory than the GPU has.
    fn = jax.jit(lambda q, k, n: da.mqa(q, k, k, kv_seq_len=n, sm_scale=SCALE, block_k=32))
    n = prefix + 1
    ms, _, _, _ = timed(fn, [(q, kv, n)] * 10)
    return {"decode_attention_us": ms * 1e3, "decode_attention_note": "latent only (1024 B/token)"}
  except Exception as e:  # noqa: BLE001 - report why it does not apply
    return {"decode_attention_us": None,
            "decode_attention_note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}


def variant_list():
  """(cell, label, run_cell keywords): kernel forms and timing probes beside the default.

  "rows_n" is the previous kernel (query rows on the wgmma N side: S^T = K Q^T, O^T = V^T P^T);
  "rows_m": 64-row tiles on the M side (S = Q K^T, O = P V; the default from 80 rows per group
  where it needs no more row tiles). The probes (on the default) drop parts of the loop (wrong
  results) to show what each part costs. First, two ways to a cheaper merge at the goal cell: half
  the default split count, and the max-first merge.
  """
  O = ta.Options
  goal = (8, 1, 32768, 17)
  out = [(goal, "22 splits (half the partials)", dict(num_splits=22)),
         (goal, "merge two_pass", dict(options=O(merge="two_pass")))]
  # The merge as one Mosaic GPU kernel against the XLA merge (2 fusions), same run, 32k cells.
  for cell in [goal, (8, 1, 32768, 9), (8, 1, 32768, 33)]:
    out.append((cell, "merge kernel (Mosaic GPU, 1 kernel)", dict(options=O(merge="kernel"))))
    # Columns per merge CTA: whole rows (one 88 KB box each at 43 splits) was the first design.
    for columns in (128, 512):
      out.append((cell, f"merge kernel {columns} columns a CTA",
                  dict(options=O(merge="kernel", merge_columns=columns))))
    out.append((cell, "merge pairwise (XLA, 2 kernels)", dict(options=O(merge="pairwise"))))
  # q_len 1 at batch 1 (8 merged rows: the XLA merge by default, 4.7 us of the 17.7-us layer at
  # 32k, whose whole call is 0.41 of the roofline): the merge kernel over 130 splits, and fewer
  # splits, beside the default in the same run.
  for cell in [(8, 1, 32768, 1), (8, 1, 131072, 1)]:
    out.append((cell, "q1 merge: default (XLA pairwise)", dict()))
    for columns in (128, 256):
      out.append((cell, f"q1 merge: kernel {columns} columns a CTA",
                  dict(options=O(merge="kernel", merge_columns=columns))))
    out.append((cell, "q1 merge: 66 splits", dict(num_splits=66)))
  # q_len 1 (8 rows a request at 8 heads) in form "rows_m": 64-row tiles with 56 padded rows, but
  # a softmax within warp quads instead of "rows_n"'s cross-warp reductions through shared memory
  # (two warpgroup barriers per tile), where the default takes "rows_n" (under 80 rows).
  for cell in [(8, 1, 32768, 1), (8, 1, 131072, 1), (8, 8, 32768, 1), (8, 32, 32768, 1)]:
    out.append((cell, "q1 form: rows_n (default)", dict()))
    out.append((cell, "q1 form: rows_m", dict(options=O(form="rows_m"))))
  # The default at these cells stages bf16 partials in shared memory for one TMA store and merges
  # them with the merge kernel: beside it the same partials merged by XLA, bf16 partials stored
  # from registers, and the previous default (fp32 partials from registers).
  for cell in [goal, (8, 1, 32768, 33), (8, 1, 32768, 65)]:
    out.append((cell, "epilogue smem + XLA merge (bf16 partials)",
                dict(partial_dtype="bfloat16", options=O(epilogue="smem", merge="pairwise"))))
    out.append((cell, "epilogue registers (bf16 partials)",
                dict(partial_dtype="bfloat16", options=O(form="rows_m", epilogue="registers"))))
    out.append((cell, "epilogue registers (fp32 partials, the previous default)",
                dict(partial_dtype="float32")))
  for cell in [goal, (8, 1, 32768, 33), (8, 1, 32768, 65), (64, 1, 32768, 9), (8, 1, 32768, 9)]:
    # Both forms with fp32 partials from registers, so that only the form differs.
    out.append((cell, "rows_n (previous kernel), fp32 partials",
                dict(partial_dtype="float32", options=O(form="rows_n"))))
    out.append((cell, "rows_m, fp32 partials", dict(partial_dtype="float32", options=O(form="rows_m"))))
  # setmaxnreg per compute warpgroup in form "rows_m": at 232/232 ptxas spills 148 bytes a thread
  # in warpgroup 0 at the goal cell, 108 at 240, 76 at 248, 48 at 256 (warpgroup 1 none at 208).
  # The two counts sum to at most 464 (504 with the memory warpgroup's 40; 512 hung the H200).
  for cell in [goal, (8, 8, 32768, 17)]:
    for regs in ((232, 232), (240, 224), (248, 216), (256, 208)):  # 232/232: the default, as a same-run baseline
      out.append((cell, f"rows_m registers {regs[0]}/{regs[1]}",
                  dict(options=O(form="rows_m", regs=regs))))
  # Options.live_splits: each request split by a count chosen from the live lengths, not by the
  # pool's (the launched count); short contexts in a long pool (run with --cached 4096 131072:
  # a 132k pool, as in the grid), beside long ones where nothing should change. Off first, in
  # the same run (the default, "auto", is on for all but the batch-1 cell).
  for cell in [(64, 8, 4096, 17), (64, 8, 4096, 9), (8, 8, 4096, 17), (8, 32, 4096, 9),
               (64, 32, 4096, 17), (8, 1, 4096, 17), (8, 8, 131072, 17), (64, 8, 131072, 9)]:
    out.append((cell, "live splits: off (pool's count)", dict(options=O(live_splits=False))))
    out.append((cell, "live splits: on", dict(options=O(live_splits=True))))
  # The same in batches of mixed lengths (cached / 32 .. cached), where the counts differ within
  # the batch and the longest request sets the time.
  for cell in [(8, 8, 131072, 17), (64, 8, 131072, 9), (8, 32, 32768, 9)]:
    out.append((cell, "mixed lengths: off (pool's count)", dict(mixed=True, options=O(live_splits=False))))
    out.append((cell, "mixed lengths: live splits on", dict(mixed=True, options=O(live_splits=True))))
  out += [(goal, "probe: no loads", dict(options=O(probe="noload"))),
          (goal, "probe: no compute", dict(options=O(probe="nocompute"))),
          (goal, "probe: no P V", dict(options=O(probe="nopv"))),
          (goal, "probe: no partial stores", dict(options=O(probe="nostore")))]
  return out


def pool_context(args) -> int:
  """The context the KV pool is sized for: ``--pool-for``, else the longest ``--cached``."""
  return max(args.cached + ([args.pool_for] if args.pool_for else []))


def run_variants(args, bandwidth, peak, results):
  pools = {}
  for (heads, batch, cached, q_len), label, kw in variant_list():
    if args.variant_match and not any(m in label for m in args.variant_match):
      continue
    if batch not in pools:
      pools.clear()
      pool_len = pool_context(args) + 4096
      rotations = max(2, min(16, math.ceil(3 * L2_BYTES / (batch * 4160 * BYTES_PER_TOKEN))))
      rotations = max(1, min(rotations, int(24e9 // (batch * pool_len * BYTES_PER_TOKEN))))
      pools[batch] = make_pool(batch, pool_len, rotations, jax.random.key(batch))
    # A cell longer than the pool (``pool_context``) is skipped, listed with those cut for time.
    if (cached > pool_context(args)
        or time.perf_counter() - args.start > args.budget_s + args.variants_budget_s):
      results["skipped_variants"].append(((heads, batch, cached, q_len), label))
      continue
    check = not label.startswith("probe")
    try:
      row = run_cell(heads, batch, cached, q_len, pools[batch], bandwidth, peak, args,
                     check=check, time_reference=False, **kw)
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      row = dict(heads=heads, batch=batch, cached=cached, q_len=q_len,
                 error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    row["variant"] = label
    results["variants"].append(row)
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
           if k in ("heads", "batch", "cached", "q_len", "variant", "time_us", "layer_us", "kernel_us",
                    "max_abs_err", "error", "splits", "row_tiles")}, flush=True)


def variants_markdown(results):
  if not results["variants"]:
    return ""
  lines = ["", "Variants and probes (`--variants`; probes give wrong results):", "",
           "| heads | batch | cached | q_len | variant | tiles x splits | time us | layer us | "
           "kernel us | roofline frac | max err |", "| --- " * 11 + "|"]
  for r in results["variants"]:
    if "error" in r:
      lines.append(f"| {r['heads']} | {r['batch']} | {r['cached'] // 1024}k | {r['q_len']} | "
                   f"{r['variant']} | - | failed: {r['error'][:80]} | | | | |")
      continue
    err = f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else "-"
    lines.append(f"| {r['heads']} | {r['batch']} | {r['cached'] // 1024}k | {r['q_len']} | "
                 f"{r['variant']} | {r['row_tiles']}x{r['splits']} | {r['time_us']:.1f} | "
                 f"{r['layer_us']:.1f} | {r['kernel_us']:.1f} | {r['roofline_fraction']:.2f} | {err} |")
  base = [r for r in results["rows"] + results["variants"] if "breakdown_us" in r
          and (r["heads"], r["batch"], r["cached"], r["q_len"]) == (8, 1, 32768, 17)
          and not r.get("variant", "").startswith("probe")]
  for r in base:
    lines += ["", f"Per-kernel median us of one call (h{r['heads']} b{r['batch']} "
              f"{r['cached'] // 1024}k q{r['q_len']}, {r.get('variant', 'default')}): " +
              ", ".join(f"{name[:40]} {us}" for name, us in r["breakdown_us"])]
    if r.get("layer_breakdown_us"):
      lines += ["", "The same, per layer (metadata precomputed): " +
                ", ".join(f"{name[:40]} {us}" for name, us in r["layer_breakdown_us"])]
  return "\n".join(lines)


def cells(args):
  """All cells: the 5x goal cell, then the issue's other goal cells (heads 8, cached >= 32k)."""
  out = []
  for heads in args.heads:
    for batch in args.batch:
      for cached in args.cached:
        for q_len in args.q_len:
          goal = heads == 8 and cached >= 32768
          first = (heads, batch, cached, q_len) == (8, 1, 32768, 17)  # the 5x goal cell
          out.append((0 if first else 1 if goal else 2, heads, batch, cached, q_len))
  out.sort(key=lambda c: (c[0], c[2], -c[3], c[1], c[4]))
  return [c[1:] for c in out]


def is_variant(r):
  return (r.get("num_splits") is not None or r.get("rows_per_tile_override") is not None
          or r.get("partial_dtype", "auto") != "auto")


RUN_KEYS = ("device", "jax", "python", "stream_GBps", "matmul_TFLOPs", "command", "seconds")


def cell_of(r):
  return (r["heads"], r["batch"], r["cached"], r["q_len"])


def load_runs(paths):
  """(runs, rows) of earlier result files (``--resume``): their default-configuration cells, each
  tagged with its run (an index into runs), the latest file's row winning where cells repeat."""
  runs, by_cell = [], {}
  for path in paths:
    old = json.loads(Path(path).read_text())
    offset = len(runs)
    runs += old.get("runs") or [{k: old[k] for k in RUN_KEYS if k in old}]
    dropped = 0
    for r in old["rows"]:
      # Failed cells are timed again; variants (and rows written before partial_dtype="auto",
      # whose default was "float32") are not the default configuration.
      if "error" not in r and not is_variant(r):
        by_cell[cell_of(r)] = dict(r, run=offset + r.get("run", 0))
      else:
        dropped += 1
    if dropped:
      print(f"--resume {path}: {dropped} rows not carried over (failed, or not the default "
            f"configuration)", flush=True)
  return runs, list(by_cell.values())


def markdown(results):
  lines = [f"# Tree-verify attention (MLA, R=512, P=64, bf16) on {results['device']}", ""]
  runs = results.get("runs") or []
  if len(runs) > 1:
    lines.append("Cells from several runs (`--resume`), each against the ceilings of its own run "
                 "(column *run*): " + "; ".join(
                     f"run {i}: stream {run['stream_GBps']:.0f} GB/s, matmul "
                     f"{run['matmul_TFLOPs']:.0f} TFLOP/s, `{run['command']}`"
                     for i, run in enumerate(runs)) + ".")
  else:
    lines.append(f"Ceilings measured in the same run: read-only stream {results['stream_GBps']:.0f} GB/s, "
                 f"bf16 matmul {results['matmul_TFLOPs']:.0f} TFLOP/s.")
  lines.append("Roofline = max(bytes / stream, flops / matmul). Times: median per-call GPU time "
               "(CUPTI: the sum of the call's kernels, launch gaps excluded).")
  lines += ["", "Columns:", "",
            "- *time us* (whole call): `mla_tree_attention(...)` alone: the window-metadata fusion, "
            "the attention kernel and the merge (by default one Mosaic GPU kernel; the XLA merge, "
            "`merge=\"pairwise\"`, is two fusions).",
            "- *layer us* (per layer): `mla_tree_attention(..., window_meta=meta)` with `meta` from "
            "`prepare_mla_window` built outside the timed call: the attention kernel and the merge. "
            "What each model layer pays: `KimiModel` builds the metadata once per step for all "
            "layers (*meta us*, timed alone: one fusion of about 1 us, or where a batch runs live splits "
            "about 8-10 us for the few small kernels that pick each request's split count).",
            "- *kernel us*: the attention kernel alone (no metadata, no merge).",
            "- *reference us*: the plain-jnp reference, whole call (it has nothing to hoist). "
            "*speedup* = reference / time; *speedup (layer)* = reference / layer.",
            "- *roofline frac* = roofline / time (whole call).", ""]
  run_col = len(runs) > 1
  lines.append(("| run " if run_col else "") +
               "| heads | batch | cached | q_len | tiles x splits | time us | layer us | kernel us | "
               "meta us | roofline us | roofline frac | TB/s | TFLOP/s | reference us | speedup | "
               "speedup (layer) | decode attn us | max err |")
  lines.append("| --- " * (18 + run_col) + "|")
  for r in sorted(results["rows"], key=lambda r: (r["heads"], r["batch"], r["cached"], r["q_len"])):
    if is_variant(r) or "error" in r:
      continue
    ref = f"{r['reference_us']:.1f}" if r.get("reference_us") else "-"
    sp = f"{r['speedup_vs_reference']:.2f}x" if r.get("speedup_vs_reference") else "-"
    spl = (f"{r['speedup_vs_reference_per_layer']:.2f}x"
           if r.get("speedup_vs_reference_per_layer") else "-")
    da = f"{r['decode_attention_us']:.1f}" if r.get("decode_attention_us") else "-"
    err = f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else "-"
    lines.append(
        (f"| {r.get('run', 0)} " if run_col else "") +
        f"| {r['heads']} | {r['batch']} | {r['cached'] // 1024}k | {r['q_len']} | "
        f"{r['row_tiles']}x{r['splits']} | {r['time_us']:.1f} | {r['layer_us']:.1f} | "
        f"{r['kernel_us']:.1f} | {r['meta_us']:.1f} | "
        f"{r['roofline_us']:.1f} | {r['roofline_fraction']:.2f} | {r['bytes_per_s'] / 1e12:.2f} | "
        f"{r['flops_per_s'] / 1e12:.0f} | {ref} | {sp} | {spl} | {da} | {err} |")
  for r in results["rows"]:
    if ((r["heads"], r["batch"], r["cached"], r["q_len"]) == (8, 1, 32768, 17) and not is_variant(r)
        and r.get("speedup_vs_reference")):
      lines += ["", f"Goal cell (heads 8, batch 1, 32k, q_len 17; goal 5x): whole call "
                f"{r['time_us']:.1f} us = {r['speedup_vs_reference']:.2f}x the reference "
                f"({r['reference_us']:.1f} us); per layer (metadata built once per step) "
                f"{r['layer_us']:.1f} us = {r['speedup_vs_reference_per_layer']:.2f}x; kernel "
                f"alone {r['kernel_us']:.1f} us."]
  tuning = [r for r in results["rows"] if is_variant(r) and "error" not in r]
  if tuning:
    lines += ["", "Variants (forced split count or row tile, bf16 partials):", "",
              "| heads | batch | cached | q_len | rows/tile | tiles x splits | partials | time us | "
              "layer us | kernel us | roofline frac | max err |", "| --- " * 12 + "|"]
    for r in tuning:
      err = f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else "-"
      lines.append(f"| {r['heads']} | {r['batch']} | {r['cached'] // 1024}k | {r['q_len']} | "
                   f"{r['rows_per_tile']} | {r['row_tiles']}x{r['splits']} | "
                   f"{r.get('partials', r['partial_dtype'])} | {r['time_us']:.1f} | {r['layer_us']:.1f} | "
                   f"{r['kernel_us']:.1f} | {r['roofline_fraction']:.2f} | {err} |")
  errors = [r for r in results["rows"] if "error" in r]
  if errors:
    lines += ["", "Failed cells:", ""] + [
        f"- heads {r['heads']} batch {r['batch']} cached {r['cached']} q_len {r['q_len']}: {r['error']}"
        for r in errors]
  if results.get("skipped"):
    what = "Not timed in any run yet" if run_col else "Skipped for time"
    lines += ["", f"{what}: {len(results['skipped'])} cells: " +
              ", ".join(f"h{h}/b{b}/{c // 1024}k/q{q}" for h, b, c, q in results["skipped"])]
  text = variants_markdown(results)
  if text:
    lines.append(text)
  if results.get("skipped_variants"):
    lines += ["", "Variants skipped for time: " + ", ".join(
        f"h{h}/b{b}/{c // 1024}k/q{q} {label}" for (h, b, c, q), label in results["skipped_variants"])]
  if not run_col:
    lines += ["", f"Command: `{results['command']}`", ""]
  else:
    lines += ["", f"Combined by `{results.get('combined_by', results['command'])}`.", ""]
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  parser.add_argument("--heads", type=int, nargs="+", default=[8, 64])
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--cached", type=int, nargs="+", default=[4096, 32768, 131072])
  parser.add_argument("--q-len", type=int, nargs="+", default=[1, 9, 17, 33, 65])
  parser.add_argument("--min-calls", type=int, default=5)
  parser.add_argument("--max-calls", type=int, default=60)
  parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting cells after this")
  parser.add_argument("--no-decode-attention", dest="decode_attention", action="store_false")
  parser.add_argument("--plot", action="store_true")
  parser.add_argument("--variants", action="store_true",
                      help="after the cells, time kernel options and probes side by side")
  parser.add_argument("--variants-budget-s", type=float, default=60.0,
                      help="stop starting variants this long after --budget-s")
  parser.add_argument("--variant-match", nargs="+", default=[],
                      help="only the variants whose label contains one of these strings")
  parser.add_argument("--name", default="bench_tree_attention")
  parser.add_argument("--pool-for", type=int, default=None,
                      help="size the KV pool for this context length (default: the longest --cached). "
                           "The launched split count follows the pool, so cells compare only between "
                           "runs with the same pool: the grid's pool is for 131072")
  parser.add_argument("--resume", type=Path, nargs="+", default=[],
                      help="earlier result JSONs whose cells are kept and not timed again")
  parser.add_argument("--render-only", action="store_true",
                      help="with --resume: write the combined JSON and markdown, time nothing")
  args = parser.parse_args()
  start = args.start = time.perf_counter()
  runs, kept = load_runs(args.resume)
  if args.render_only:
    if not runs:
      parser.error("--render-only needs --resume")
    results = dict(runs[-1], runs=runs, rows=kept, skipped=[c for c in cells(args) if c not in
                                                         {cell_of(r) for r in kept}],
                   variants=[], skipped_variants=[],
                   combined_by="python3 " + " ".join(sys.argv))
    write(args, results)
    return
  bandwidth, peak = ceilings()
  print(f"stream {bandwidth / 1e9:.0f} GB/s, matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
  results = {"device": str(jax.devices()[0]), "jax": jax.__version__,
             "python": platform.python_version(), "stream_GBps": bandwidth / 1e9,
             "matmul_TFLOPs": peak / 1e12, "command": "python3 " + " ".join(sys.argv),
             "rows": kept, "skipped": [], "variants": [], "skipped_variants": []}
  if runs:
    results["runs"] = runs + [{k: results[k] for k in RUN_KEYS if k in results}]
  this_run = len(runs)
  max_cached = pool_context(args)
  pools = {}
  todo = [c for c in cells(args) if c not in {cell_of(r) for r in kept}]
  for i, (heads, batch, cached, q_len) in enumerate(todo):
    if time.perf_counter() - start > args.budget_s:
      results["skipped"] = todo[i:]
      break
    if batch not in pools:
      pools.clear()
      # One pool per batch size, long enough for every cached length (the kernel reads only each
      # request's live columns), with enough slot rotations that timed calls miss L2.
      pool_len = max_cached + 4096  # a multiple of 4096 for the decode-attention baseline
      per_set = batch * pool_len * BYTES_PER_TOKEN
      rotations = max(2, min(16, math.ceil(3 * L2_BYTES / (batch * 4160 * BYTES_PER_TOKEN))))
      rotations = max(1, min(rotations, int(24e9 // per_set)))
      pools[batch] = make_pool(batch, pool_len, rotations, jax.random.key(batch))
    try:
      row = run_cell(heads, batch, cached, q_len, pools[batch], bandwidth, peak, args)
    except Exception as e:  # noqa: BLE001 - one failing cell must not lose the others
      traceback.print_exc()
      row = dict(heads=heads, batch=batch, cached=cached, q_len=q_len,
                 error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    row["run"] = this_run
    results["rows"].append(row)
    msg = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
           if k in ("heads", "batch", "cached", "q_len", "time_us", "layer_us", "kernel_us",
                    "meta_us", "roofline_us", "roofline_fraction", "reference_us",
                    "speedup_vs_reference", "speedup_vs_reference_per_layer", "max_abs_err",
                    "layer_equals_call",
                    "decode_attention_us", "error", "splits", "row_tiles", "compile_s")}
    print(msg, flush=True)
    if (heads, batch, cached, q_len) == (8, 1, 32768, 17):
      print("  per-kernel us:", row.get("breakdown_us"), flush=True)
      print("  per-kernel us, per layer:", row.get("layer_breakdown_us"), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
  pools.clear()
  if args.variants:
    run_variants(args, bandwidth, peak, results)
  results["seconds"] = time.perf_counter() - start
  if runs:
    results["runs"][-1]["seconds"] = results["seconds"]
  write(args, results)


def write(args, results):
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
  (args.out / f"{args.name}.md").write_text(markdown(results))
  print(markdown(results))
  if args.plot:
    plot(results, args.out / f"{args.name}.png")


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in results["rows"] if "error" not in r and not is_variant(r)]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  for ax, heads in zip(axes, (8, 64)):
    for batch, marker in zip((1, 8, 32), "os^"):
      for cached, color in zip((4096, 32768, 131072), ("tab:blue", "tab:orange", "tab:green")):
        pts = sorted((r["q_len"], r["roofline_fraction"]) for r in rows
                     if r["heads"] == heads and r["batch"] == batch and r["cached"] == cached)
        if pts:
          ax.plot(*zip(*pts), marker=marker, color=color,
                  label=f"b{batch} {cached // 1024}k")
    ax.axhline(0.7, color="gray", ls="--", lw=1)
    ax.set_title(f"{heads} heads")
    ax.set_xlabel("q_len")
  axes[0].set_ylabel("fraction of roofline")
  for ax in axes:
    if ax.lines:
      ax.legend(fontsize=7, ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
