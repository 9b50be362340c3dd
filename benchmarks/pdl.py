"""Programmatic dependent launch (PDL) for the Pallas kernels, off against on, side by side (H200).

    PYTHONPATH=. python3 benchmarks/pdl.py --out benchmarks/results   # on the GPU

With ``KernelTiles.pdl`` / ``Options.pdl`` each Mosaic GPU kernel of a call starts with
``griddepcontrol.wait`` then ``griddepcontrol.launch_dependents`` (``gpu_info.pdl_prologue``), so
the driver may launch it while the kernel before it drains. That can only shorten the device
*span* of a step (first kernel's start to last kernel's end); the CUPTI *sum* of kernel times,
which the other tables report, counts a kernel's wait for its predecessor as its own time, so
it does not show the gain and may grow. Both are reported.

Cells: the MoE layer at the 48-expert share (``moe_share``: 16 routings as the calls of one
executable; INT4 and bf16 at T = 1, INT4 at T = 9) and the tree attention per layer (the
window metadata prepared once, as the model does; 16 calls in one executable, each preceded by a
small XLA fusion that makes its queries from the previous call's output, as a model layer's
projections would), with the plain-jnp reference timed the same way at the goal cell. Each
variant's executables run in turn ``--repeats`` times; outputs must equal bit for bit.
"""

import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_moe
import bench_tree_attention as bta
import moe_share
import moe_timeline
import results_io
from pallas_kernels import moe, reference
from pallas_kernels import tree_attention as ta

CALLS = 16
REPEATS = 5
MOE_CELLS = (("int4", 1), ("bf16", 1), ("int4", 9))  # the 48-expert share
ATTENTION_CELLS = ((1, 32768, 17), (1, 32768, 1), (1, 32768, 9), (1, 32768, 65), (8, 32768, 17))  # heads 8
EXPERTS = 48
HEADS = 8
ROTATIONS = 4  # pool slots per request, so that successive calls do not find their KV in L2


def step_us(step, *args) -> dict:
  """{'span', 'busy', 'sum'} us per call of one traced execution of ``step`` (``jax.profiler``'s
  device trace, ``moe_timeline``; one profiler only: CUPTI's Mosaic GPU profiler beside it drops
  records)."""
  events = moe_timeline.device_events(step, *args)
  s = moe_timeline.summarize(events, CALLS)
  return dict(span=s["span_us"], busy=s["busy_us"], sum=sum(d for _, d, _ in events) / 1e3 / CALLS)


def ceilings() -> tuple:
  """(read-only stream bytes/s, bf16 matmul FLOP/s) measured here, by the same device trace."""
  x = jax.random.normal(jax.random.key(0), (1 << 31,), jnp.bfloat16)  # 4 GiB
  stream = jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32))
  seconds = statistics.median(
      sum(d for _, d, _ in moe_timeline.device_events(stream, x)) * 1e-9 for _ in range(5))
  bandwidth = x.size * 2 / seconds
  del x
  a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
  mm = jax.jit(lambda p, q: p @ q)
  seconds = statistics.median(sum(d for _, d, _ in moe_timeline.device_events(mm, a, b)) * 1e-9 for _ in range(5))
  return bandwidth, 2 * 8192**3 / seconds


def time_pair(steps: dict, args: dict, repeats: int) -> dict:
  """{variant: {'span', 'busy', 'sum'}} medians over ``repeats`` rounds, the variants in turn
  (``args``: {variant: its step's arguments})."""
  samples = {name: {"span": [], "busy": [], "sum": []} for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      for k, v in step_us(step, *args[name]).items():
        samples[name][k].append(v)
  return {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}


def moe_rows(repeats: int, stream: float) -> list:
  rows = []
  for fmt, tokens in MOE_CELLS:
    make = bench_moe.make_int4 if fmt == "int4" else bench_moe.make_bf16
    w = make(jax.random.key(EXPERTS + 1), EXPERTS)
    cell = moe_share.pair_cell(EXPERTS) if tokens == 1 else moe_share.sorted_cell(EXPERTS, tokens)
    base = moe.default_tiles(w, cell.expected_rows)

    def layer(tiles):
      if tokens == 1:
        return lambda x, ids, w: moe.moe_experts_per_row(x, ids, w, expected_rows=cell.expected_rows, tiles=tiles)
      return lambda x, g, w: moe.moe_experts(x, g, w, expected_rows=cell.expected_rows, tiles=tiles)

    steps = {pdl: bench_moe.in_step(layer(dataclasses.replace(base, pdl=pdl))) for pdl in (False, True)}
    xs, gs = [c[0] for c in cell.calls][:CALLS], [c[1] for c in cell.calls][:CALLS]
    outs = {pdl: np.asarray(jnp.stack(step(xs, gs, w)).astype(jnp.float32)) for pdl, step in steps.items()}
    timed = time_pair(steps, {pdl: (xs, gs, w) for pdl in steps}, repeats)
    roofline_us = bench_moe.weight_bytes(fmt, cell.touched) / stream * 1e6
    for pdl in (False, True):
      t = timed[pdl]
      rows.append(dict(kind="moe", cell=f"{fmt} {EXPERTS}e T={tokens}", pdl=pdl, roofline_us=roofline_us,
                       **{f"{k}_us": v for k, v in t.items()},
                       span_fraction=roofline_us / t["span"], sum_fraction=roofline_us / t["sum"],
                       span_vs_off=t["span"] / timed[False]["span"],
                       rows="bit-identical" if np.array_equal(outs[pdl], outs[False]) else "DIFFER"))
      print(rows[-1], flush=True)
  return rows


def attention_step(layer, calls: int = CALLS):
  """One executable of ``calls`` attention calls; before each, one small fusion makes its queries
  from the previous output (as a layer's projections would), so the calls chain."""
  layer = jax.jit(layer)  # lowered once, called per layer

  @jax.jit
  def step(q_lat, q_rope, c_kv, k_pe, slot_sets, prefix, visibility, valid, metas):
    outs, carry = [], jnp.float32(0.0)
    for i in range(calls):
      shift = (1.0 + 1e-3 * carry).astype(jnp.bfloat16)
      out = layer(q_lat * shift, q_rope, c_kv, k_pe, slot_sets[i % len(slot_sets)], prefix, visibility, valid,
                  metas[i % len(metas)])
      carry = jnp.mean(out[:, 0, 0, :8])
      outs.append(out)
    return outs
  return step


def attention_rows(repeats: int, bandwidth: float, peak: float) -> list:
  rows = []
  for batch, cached, q_len in ATTENTION_CELLS:
    pool = bta.make_pool(batch, cached + 128, ROTATIONS, jax.random.key(batch * 7 + q_len))
    key = jax.random.key(batch * 101 + cached + q_len)
    kq, kr, kw = jax.random.split(key, 3)
    q_lat = jax.random.normal(kq, (batch, q_len, HEADS, bta.LATENT), jnp.bfloat16)
    q_rope = jax.random.normal(kr, (batch, q_len, HEADS, bta.ROPE), jnp.bfloat16)
    prefix, visibility, valid = bta.window(batch, q_len, cached, kw)
    slot_sets = [jnp.arange(r * batch, (r + 1) * batch, dtype=jnp.int32) for r in range(ROTATIONS)]
    steps, metas = {}, {}
    for pdl in (False, True):
      options = ta.Options(pdl=pdl)
      prepare = functools.partial(ta.prepare_mla_window, heads=HEADS, latent_dim=bta.LATENT, rope_dim=bta.ROPE,
                                  cache_len=pool[0].shape[1], options=options)
      metas[pdl] = [prepare(s, prefix, visibility, valid) for s in slot_sets]
      layer = lambda *a, options=options: ta.mla_tree_attention(*a[:8], scale=bta.SCALE, options=options,
                                                                window_meta=a[8])
      steps[pdl] = attention_step(layer)
    args = {pdl: (q_lat, q_rope, *pool, slot_sets, prefix, visibility, valid, metas[pdl]) for pdl in (False, True)}
    outs = {pdl: np.asarray(jnp.stack(steps[pdl](*args[pdl]))) for pdl in (False, True)}
    timed = time_pair(steps, args, repeats)
    reference_us = None
    if (batch, q_len) == (1, 17):
      # The plain-jnp reference reads every pool column: a pool of exactly cached + q_len columns.
      small = tuple(p[:, :cached + q_len] for p in pool)
      ref_layer = lambda *a: reference.mla_tree_attention(*a[:8], scale=bta.SCALE)
      ref_step = attention_step(ref_layer)
      ref_args = (q_lat, q_rope, *small, slot_sets, prefix, visibility, valid, [None])
      ref = [step_us(ref_step, *ref_args) for _ in range(3)]
      reference_us = {k: statistics.median(r[k] for r in ref) for k in ("span", "sum")}
    roofline_us = bta.cell_metrics(HEADS, batch, cached, q_len, 1.0, bandwidth, peak)["roofline_us"]
    for pdl in (False, True):
      t = timed[pdl]
      row = dict(kind="attention", cell=f"h{HEADS} b{batch} {cached // 1024}k q{q_len}", pdl=pdl,
                 roofline_us=roofline_us, **{f"{k}_us": v for k, v in t.items()},
                 span_fraction=roofline_us / t["span"], sum_fraction=roofline_us / t["sum"],
                 span_vs_off=t["span"] / timed[False]["span"],
                 rows="bit-identical" if np.array_equal(outs[pdl], outs[False]) else "DIFFER")
      if reference_us:
        row.update(reference_span_us=reference_us["span"], reference_sum_us=reference_us["sum"],
                   speedup_span=reference_us["span"] / t["span"], speedup_sum=reference_us["sum"] / t["sum"])
      rows.append(row)
      print(row, flush=True)
  return rows


def markdown(result: dict) -> str:
  lines = [f"# Programmatic dependent launch, off against on ({result['device']}, jax {result['jax']})", "",
           f"Per call, {CALLS} calls in one executable, medians of {result['repeats']} rounds (the variants in turn). "
           "*span*: first kernel's start to last kernel's end over the step, per call (what the step takes on "
           "the device); *busy*: time some kernel ran; *sum*: CUPTI's kernel times added (a kernel waiting for "
           "its predecessor under PDL counts that wait). MoE: the 48-expert share, `bench_moe.py`'s routings; "
           "attention: heads 8, per layer (metadata prepared outside), a small XLA fusion before each call. "
           f"Stream {result['stream_GBps']:.0f} GB/s, matmul {result['matmul_TFLOPs']:.0f} TFLOP/s (this run).", "",
           "| kind | cell | PDL | span us | busy us | sum us | roofline us | of roofline (span) | of roofline (sum) "
           "| span vs off | reference span / sum us | speedup (span) | rows |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    ref = f"{r['reference_span_us']:.1f} / {r['reference_sum_us']:.1f}" if "reference_span_us" in r else "-"
    speed = f"{r['speedup_span']:.2f}x" if "speedup_span" in r else "-"
    lines.append(f"| {r['kind']} | {r['cell']} | {'on' if r['pdl'] else 'off'} | {r['span_us']:.1f} | "
                 f"{r['busy_us']:.1f} | {r['sum_us']:.1f} | {r['roofline_us']:.1f} | {r['span_fraction']:.1%} | "
                 f"{r['sum_fraction']:.1%} | {r['span_vs_off']:.3f}x | {ref} | {speed} | {r['rows']} |")
  return results_io.with_command(lines, result)


def main():
  parser = results_io.results_parser(__doc__, "pdl")
  parser.add_argument("--repeats", type=int, default=REPEATS)
  parser.add_argument("--skip", choices=("moe", "attention"), action="append", default=[])
  args = parser.parse_args()
  results_io.check_positive(parser, repeats=args.repeats)
  results_io.require_gpu("pdl.py")
  start = time.perf_counter()
  bandwidth, peak = ceilings()
  rows = []
  if "attention" not in args.skip:
    rows += attention_rows(args.repeats, bandwidth, peak)
  if "moe" not in args.skip:
    rows += moe_rows(args.repeats, bandwidth)
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=False, cell=lambda r: (r["kind"], r["cell"], r["pdl"]), repeats=args.repeats,
                       stream_GBps=bandwidth / 1e9, matmul_TFLOPs=peak / 1e12)


if __name__ == "__main__":
  main()
