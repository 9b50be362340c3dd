"""GPU time of jitted calls from CUPTI's kernel records (the device's own clock, host time excluded)."""

import re
import statistics


def kernel_times(fn, *args, iterations: int = 5):
  """[[(kernel name, ms), ...] per iteration] of ``fn(*args)``, in launch order.

  CUPTI records every kernel the call runs, also inside XLA's command buffers (CUDA graphs); the
  sum over one iteration is the GPU's busy time for it, without the host-side dispatch and graph
  launch time that a wall clock also counts. One warm-up call runs first.
  """
  from jax.experimental.mosaic.gpu import profiler  # GPU-only bindings

  _, timings = profiler.Cupti().measure(fn, aggregate=False, iterations=iterations)(*args)
  if timings is None:
    raise RuntimeError("CUPTI recorded no kernels")
  return [timings] if iterations == 1 else timings


def per_call_device_us(fn, args, calls: int, iterations: int = 5):
  """(median GPU us per call, {kernel kind: us per call}) for an executable that runs ``calls``
  calls back to back (``fn(*args)``). Kinds are kernel names without XLA's numeric suffix (the
  calls' copies of one fusion differ only in it), summed over a run and divided by ``calls``."""
  runs = kernel_times(fn, *args, iterations=iterations)
  totals = [sum(ms for _, ms in run) * 1e3 / calls for run in runs]
  kinds = {}
  for name, ms in runs[len(runs) // 2]:
    kind = re.sub(r"(_\d+)+$", "", name)
    kinds[kind] = kinds.get(kind, 0.0) + ms * 1e3 / calls
  return statistics.median(totals), dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
