"""Where a MoE layer call's time goes on the GPU: kernel time against wall time per call.

    PYTHONPATH=. python3 benchmarks/moe_timeline.py int4:384:1 int4:48:9 int4:384:17   # on the GPU

For each ``format:experts:tokens`` cell, runs ``bench_moe``'s in-step executable (the layer on 16
routings, one host dispatch) and reports, per layer call: the wall time (``bench_moe``'s timing),
the time some kernel was running on the device, the device span from the first kernel's start to
the last one's end, the kernels launched, and the kernels that took the most time. It reads one
step's device trace from ``jax.profiler`` (CUPTI). Wall well above span means time the GPU was
never given work: host-side dispatch, not the kernels.

It also times steps of 16 and of 64 layer calls and splits the wall time into a part per step and
a part per call (the slope): what a layer call adds to a model step's wall time. The executable
runs as one CUDA graph (XLA's command buffers), so host-side work per call (updating and
launching the graph's nodes) shows in the slope even though the device trace has no gaps.
"""

import glob
import sys
import tempfile

import jax
from jax.profiler import ProfileData

import bench_moe


def device_events(step, *args):
  """[(start_ns, duration_ns, name)] of every kernel on the GPU during one call of ``step``."""
  jax.block_until_ready(step(*args))  # compiled and warm before the traced call
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    jax.block_until_ready(step(*args))
    jax.profiler.stop_trace()
    data = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
  plane = next(p for p in data.planes if p.name.startswith("/device:GPU"))
  lines = [line for line in plane.lines if "Stream" in line.name]
  return sorted((e.start_ns, e.duration_ns, e.name) for line in lines for e in line.events)


def summarize(events, calls: int) -> dict:
  busy, covered_to = 0.0, events[0][0]
  by_name: dict[str, float] = {}
  for start, duration, name in events:
    end = start + duration
    if end > covered_to:
      busy += end - max(start, covered_to)
      covered_to = end
    by_name[name[:40]] = by_name.get(name[:40], 0.0) + duration
  top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
  return {"busy_us": busy / 1e3 / calls, "span_us": (covered_to - events[0][0]) / 1e3 / calls,
          "kernels": len(events) / calls, "top_us": [(n, round(t / 1e3 / calls, 1)) for n, t in top]}


def main():
  if jax.default_backend() != "gpu":
    raise SystemExit("moe_timeline.py needs a CUDA GPU")
  for cell in sys.argv[1:]:
    fmt, experts, tokens = cell.split(":")
    experts, tokens = int(experts), int(tokens)
    make = bench_moe.make_int4 if fmt == "int4" else bench_moe.make_bf16
    weights = make(jax.random.key(experts), experts)
    sets = bench_moe.routings(tokens, experts, seed=1000 * experts + tokens)
    step = bench_moe.in_step(bench_moe.IMPLS["pallas"])
    wall_us = bench_moe.timed_in_step(step, sets, weights) * 1e6
    s = summarize(device_events(step, [x for x, _, _ in sets], [g for _, g, _ in sets], weights), len(sets))
    print(f"{cell}: wall {wall_us:.0f} us/call; device busy {s['busy_us']:.0f} us/call, span {s['span_us']:.0f} "
          f"us/call, {s['kernels']:.1f} kernels/call; most time: {s['top_us']}", flush=True)
    more = [r for k in range(1, 4) for r in bench_moe.routings(tokens, experts, seed=1000 * experts + tokens + 7 * k)]
    step_us = {n: bench_moe.timed_in_step(bench_moe.in_step(bench_moe.IMPLS["pallas"]), (sets + more)[:n], weights,
                                          repeats=7) * 1e6 * n for n in (16, 64)}
    slope = (step_us[64] - step_us[16]) / 48
    print(f"{cell}: steps of 16 / 64 calls {step_us[16]:.0f} / {step_us[64]:.0f} us: {slope:.0f} us per call "
          f"(device busy {s['busy_us']:.0f}) and {step_us[16] - 16 * slope:.0f} us per step", flush=True)


if __name__ == "__main__":
  main()
