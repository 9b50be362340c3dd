"""Where a demo-pair engine step's time goes on the GPU at batch 1, under XLA's launch settings.

    PYTHONPATH=. python3 benchmarks/step_overhead.py --out benchmarks/results     # on the GPU

At batch 1 the demo pair's steps are host-bound (`bench_spec.md`: about 60% of a 1.8-2.4 ms step
is host time), while DESIGN §4 measured 376 us a step for a decoder of similar size dispatched the
same way. For each ``XLA_FLAGS`` variant below, in a process of its own (XLA reads the flags once):
the engine's greedy steps at budgets 0 and 16, batch 1, bf16 (5 held-out prompts x 128 tokens):

* tokens/s, and the median step wall time and host time of ``engine.StepStats``;
* *raw*: the same step dispatched 40 times without reading its output (``Batch.dispatch`` alone):
  wall time per step and the dispatch call's own time, i.e. XLA's execution without the
  engine's per-step reading and bookkeeping;
* from a ``jax.profiler`` trace of 16 steps run as the engine runs them (dispatch the next, then
  read the last; the prompt prefilled before the trace): kernels and memory copies or sets per
  step, and the time per step that some kernel ran (*busy*) against the device span.

Busy well below the step's wall time means the GPU waits for the host: launches (the layer scans'
``while`` loops run on the host unless XLA's command buffers take them in) or the engine's own
reading. The variant "default, read at collect" turns off the copy that ``Batch.dispatch`` starts
(2026-12-07), so the step's packed output is copied only when ``collect`` asks for it, beside the
engine that starts that copy as it dispatches the step. (It does so by making jax's
``copy_to_host_async`` a no-op in its process, so ``device_get`` cannot start several arrays'
copies together either: a step that also reads admitted requests' first tokens reads them one
after another, a slightly pessimistic baseline.) The engine before that change, with seven
output arrays, is in ``results/step_overhead_before_*.md``. Writes ``step_overhead.{json,md}``.
"""

import argparse
import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from jax.profiler import ProfileData

import moe_timeline
from ddtree_jax import engine
from models import dflash, loading

VARIANTS = {
    "default": "",
    "default, read at collect": "",
    "command buffers off": "--xla_gpu_enable_command_buffer=",
    "+ while and conditional": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    "graphs from 1 op": "--xla_gpu_graph_min_graph_size=1",
}
# The packed step output copied to the host only when ``collect`` reads it (``Batch.dispatch``
# starts that copy as it dispatches the step since 2026-12-07).
READ_AT_COLLECT = "default, read at collect"
BUDGETS = (0, 16)
RAW_STEPS = 40
TRACE_STEPS = 16


def summarize(events, steps: int) -> dict:
  """Per step, from a trace's device events [(start_ns, duration_ns, name)]: kernels, memory
  copies and sets, the time some kernel ran (overlaps counted once) and the span of the kernels."""
  is_copy = lambda name: "memcpy" in name.lower() or "memset" in name.lower()
  kernels = moe_timeline.summarize(sorted(e for e in events if not is_copy(e[2])), steps)
  return {"kernels_per_step": kernels["kernels"], "copies_per_step": sum(is_copy(e[2]) for e in events) / steps,
          "busy_us_per_step": kernels["busy_us"], "span_us_per_step": kernels["span_us"]}


def trace_events(run):
  """Device events [(start_ns, duration_ns, name)] of the GPU during ``run()``."""
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    result = run()
    jax.profiler.stop_trace()
    data = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
  plane = next(p for p in data.planes if p.name.startswith("/device:GPU"))
  return result, [(e.start_ns, e.duration_ns, e.name) for line in plane.lines for e in line.events
                  if "Stream" in line.name or "Memcpy" in line.name]


def trace_engine_steps(batch, budget: int, steps: int):
  """Device events of ``steps`` steps of ``batch`` run as the engine runs them: dispatch the next
  step, then read the last."""
  def run():
    pending = batch.dispatch(budget)
    for _ in range(steps - 1):
      pending, last = batch.dispatch(budget), pending
      batch.collect(last)
    batch.collect(pending)
  return trace_events(run)[1]


def measure(variant: str) -> dict:
  """One variant's cells (run in a child process with its XLA_FLAGS)."""
  if variant == READ_AT_COLLECT:
    from jax._src.array import ArrayImpl  # pylint: disable=import-outside-toplevel
    ArrayImpl.copy_to_host_async = lambda self: None  # this child process only
  target = loading.load_kimi("kimi-demo", dtype="bfloat16")
  draft = loading.load_dflash("kimi-demo-dflash", dtype="bfloat16")
  held = json.loads((loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json").read_text())["prompts"]
  prompts = [p["tokens"] for p in held[:6]]
  t0 = time.perf_counter()
  decoder = engine.SpeculativeDecoder(target, dflash.DFlashDrafter(draft.cfg), dflash.DFlashDrafter.params(draft, target),
                                      policy="ddtree", budgets=BUDGETS, batch_buckets=(1,), max_len=512,
                                      show_progress=False)
  row = {"variant": variant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "compile_s": time.perf_counter() - t0}
  def fresh_batch(budget):
    """One running request, prefilled and one step in, so neither is timed or traced."""
    batch = engine.Batch(decoder, 1)
    batch.admit(decoder.request(prompts[0], 300, stop_token_ids=[]))
    batch.collect(batch.dispatch(budget))
    return batch

  for budget in BUDGETS:
    decoder.generate(prompts[:1], 32, budget=budget, stop_token_ids=[])  # warm
    steps, tokens, seconds = [], 0, 0.0
    for prompt in prompts[1:]:
      result = decoder.generate([prompt], 128, budget=budget, stop_token_ids=[])
      steps += result.steps[1:]
      tokens += len(result.tokens[0])
      seconds += result.decode_time
    batch = fresh_batch(budget)
    dispatch_s, start = [], time.perf_counter()
    for _ in range(RAW_STEPS):
      t = time.perf_counter()
      handle = batch.dispatch(budget)
      dispatch_s.append(time.perf_counter() - t)
    jax.block_until_ready(handle[1])
    raw_step_s = (time.perf_counter() - start) / RAW_STEPS
    batch.close()
    batch = fresh_batch(budget)
    events = trace_engine_steps(batch, budget, TRACE_STEPS)
    batch.close()
    row[f"budget {budget}"] = {
        "tokens_per_s": tokens / seconds, "step_ms": 1e3 * float(np.median([s.step_time for s in steps])),
        "host_ms": 1e3 * float(np.median([s.host_time for s in steps])), "raw_step_ms": 1e3 * raw_step_s,
        "raw_dispatch_ms": 1e3 * float(np.median(dispatch_s)), **summarize(events, TRACE_STEPS)}
  return row


def markdown(result: dict) -> str:
  lines = [f"# A demo-pair engine step at batch 1 under XLA's launch settings ({result['device']}, jax {result['jax']})",
           "", "bf16, greedy, 5 held-out prompts x 128 tokens; *raw*: the step dispatched 40 times without reading "
           "it; kernels, memory copies and sets, busy and span per step from a device trace of 16 steps.", "",
           "| variant | budget | tok/s | step ms | host ms | raw step ms | raw dispatch ms | kernels | copies | "
           "busy us | span us |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    if "error" in row:
      error = row["error"][-200:].replace("\n", " ").replace("|", "/")
      lines.append(f"| {row['variant']} | failed: {error} | | | | | | | | | |")
      continue
    for budget in BUDGETS:
      c = row[f"budget {budget}"]
      lines.append(f"| {row['variant']} | {budget} | {c['tokens_per_s']:.0f} | {c['step_ms']:.3f} | {c['host_ms']:.3f} | "
                   f"{c['raw_step_ms']:.3f} | {c['raw_dispatch_ms']:.3f} | {c['kernels_per_step']:.0f} | "
                   f"{c['copies_per_step']:.1f} | {c['busy_us_per_step']:.0f} | {c['span_us_per_step']:.0f} |")
  lines += ["", "Variants' `XLA_FLAGS`: " + "; ".join(f"{k}: `{v or '(none)'}`" for k, v in VARIANTS.items()), "",
            f"Command: `PYTHONPATH=. python3 benchmarks/step_overhead.py {' '.join(result['argv'])}`"]
  return "\n".join(lines) + "\n"


def main():
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    print("RESULT " + json.dumps(measure(sys.argv[2])), flush=True)
    return
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  parser.add_argument("--timeout-s", type=float, default=240.0, help="per variant")
  args = parser.parse_args()
  # The variants run in child processes: this one must not hold most of the GPU's memory.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if jax.default_backend() != "gpu":
    raise SystemExit("step_overhead.py needs a CUDA GPU")
  rows = []
  for variant, flags in VARIANTS.items():
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    try:
      child = subprocess.run([sys.executable, __file__, "--child", variant], env=env, capture_output=True, text=True,
                             timeout=args.timeout_s, check=False)
      found = [line[7:] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
      rows.append(json.loads(found[0]) if found else
                  {"variant": variant, "error": f"exit {child.returncode}: {child.stderr.strip()[-500:]}"})
    except subprocess.TimeoutExpired:
      rows.append({"variant": variant, "error": f"over {args.timeout_s} s"})
    print(json.dumps(rows[-1]), flush=True)
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv[1:], "rows": rows}
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "step_overhead.json").write_text(json.dumps(result, indent=1))
  (args.out / "step_overhead.md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  main()
