"""The 5x goal cell of the tree attention (heads 8, batch 1, 32k cached, q_len 17), against the
plain-jnp reference on a pool of its own and on a serving pool (H200).

    PYTHONPATH=. python3 benchmarks/attention_goal_cell.py --out benchmarks/results   # on the GPU

``bench_tree_attention.py`` gives the reference a pool of exactly one slot of ``cached + q_len``
columns, so XLA drops its gather of the request's slot; a server's pool holds many slots, and the
same plain-jnp code then gathers the slot's 37.7 MB first. This times, each as separate calls
(GPU time of the call's kernels from one ``jax.profiler`` trace per call, median of ``--calls``,
calls rotating over 4 slots so that no call finds its KV in L2): the kernel's whole call, its
per-layer call (window metadata prepared outside, as the model does), the reference on the
one-slot pool and the reference on a 4-slot pool of the same length (slot ids 0..3).
"""

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import bench_tree_attention as bta
import moe_timeline
import results_io
from pallas_kernels import reference
from pallas_kernels import tree_attention as ta

HEADS, BATCH, CACHED, Q_LEN = 8, 1, 32768, 17
SLOTS = 4
CALLS = 12


def call_us(fn, *args) -> float:
  """GPU us of one call of ``fn``: its kernels' times from one device trace (``moe_timeline``)."""
  return sum(d for _, d, _ in moe_timeline.device_events(fn, *args)) / 1e3


def median_us(fn, arg_sets) -> float:
  return statistics.median(call_us(fn, *args) for args in arg_sets)


def main():
  parser = results_io.results_parser(__doc__, "attention_goal_cell")
  parser.add_argument("--calls", type=int, default=CALLS)
  args = parser.parse_args()
  results_io.check_positive(parser, calls=args.calls)
  results_io.require_gpu("attention_goal_cell.py")
  start = time.perf_counter()
  columns = CACHED + Q_LEN
  # The kernel's pool has the tile-aligned length the engine allocates (an unaligned pool would
  # be padded, i.e. copied, in every call); the reference's holds exactly the window's columns.
  pool_len = ta.padded_cache_len(columns)
  kernel_pool = bta.make_pool(BATCH, pool_len, SLOTS, jax.random.key(1))
  c_kv, k_pe = (jnp.array(p[:, :columns]) for p in kernel_pool)
  kq, kr, kw = jax.random.split(jax.random.key(2), 3)
  q_lat = jax.random.normal(kq, (BATCH, Q_LEN, HEADS, bta.LATENT), jnp.bfloat16)
  q_rope = jax.random.normal(kr, (BATCH, Q_LEN, HEADS, bta.ROPE), jnp.bfloat16)
  prefix, visibility, valid = bta.window(BATCH, Q_LEN, CACHED, kw)
  slot_ids = [jnp.full((BATCH,), s, jnp.int32) for s in range(SLOTS)]
  window = (prefix, visibility, valid)

  kernel = jax.jit(functools.partial(ta.mla_tree_attention, scale=bta.SCALE))
  prepare = jax.jit(functools.partial(ta.prepare_mla_window, heads=HEADS, latent_dim=bta.LATENT,
                                      rope_dim=bta.ROPE, cache_len=pool_len))
  metas = [prepare(s, *window) for s in slot_ids]
  layer = jax.jit(lambda *a: ta.mla_tree_attention(*a[:8], scale=bta.SCALE, window_meta=a[8]))
  ref = jax.jit(functools.partial(reference.mla_tree_attention, scale=bta.SCALE))
  one_slot = (jnp.array(c_kv[:1]), jnp.array(k_pe[:1]))
  zero = jnp.zeros((BATCH,), jnp.int32)

  sets = lambda make: [make(i % SLOTS) for i in range(args.calls)]
  timings = dict(
      kernel_call=median_us(kernel, sets(lambda s: (q_lat, q_rope, *kernel_pool, slot_ids[s], *window))),
      kernel_layer=median_us(layer, sets(lambda s: (q_lat, q_rope, *kernel_pool, slot_ids[s], *window, metas[s]))),
      reference_one_slot=median_us(ref, sets(lambda s: (q_lat, q_rope, *one_slot, zero, *window))),
      reference_serving_pool=median_us(ref, sets(lambda s: (q_lat, q_rope, c_kv, k_pe, slot_ids[s], *window))))
  got = kernel(q_lat, q_rope, *kernel_pool, slot_ids[2], *window)
  want = ref(q_lat, q_rope, c_kv, k_pe, slot_ids[2], *window)
  row = dict(heads=HEADS, batch=BATCH, cached=CACHED, q_len=Q_LEN, slots=SLOTS, calls=args.calls,
             **{f"{k}_us": v for k, v in timings.items()},
             max_abs_err=float(jnp.max(jnp.where(valid[:, :, None, None], jnp.abs(got - want), 0))))
  for ref_name in ("reference_one_slot", "reference_serving_pool"):
    for kernel_name in ("kernel_call", "kernel_layer"):
      row[f"{ref_name}_over_{kernel_name}"] = timings[ref_name] / timings[kernel_name]
  print(row, flush=True)
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows([row], out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=False, cell=lambda r: (r["heads"],))


def markdown(result: dict) -> str:
  r = result["rows"][0]
  lines = [f"# Tree attention at the 5x goal cell ({result['device']}, jax {result['jax']})", "",
           f"Heads {r['heads']}, batch {r['batch']}, {r['cached']} cached, q_len {r['q_len']}; GPU us per call "
           f"(the call's kernels, one device trace per call, median of {r['calls']} calls over {r['slots']} slots).", "",
           "| call | GPU us | reference (one-slot pool) / it | reference (4-slot pool) / it |",
           "| --- | --- | --- | --- |"]
  for name, label in (("kernel_call", "kernel, whole call (metadata inside)"),
                      ("kernel_layer", "kernel, per layer (metadata prepared once a step)")):
    lines.append(f"| {label} | {r[f'{name}_us']:.1f} | {r[f'reference_one_slot_over_{name}']:.2f}x | "
                 f"{r[f'reference_serving_pool_over_{name}']:.2f}x |")
  lines.append(f"| reference, one-slot pool of exactly the columns | {r['reference_one_slot_us']:.1f} | - | - |")
  lines.append(f"| reference, 4-slot pool of the same length | {r['reference_serving_pool_us']:.1f} | - | - |")
  lines += ["", f"Largest error of the kernel against the reference over the real rows: {r['max_abs_err']:.1e}."]
  return results_io.with_command(lines, result)


if __name__ == "__main__":
  main()
