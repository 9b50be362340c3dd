"""Facts about the GPU the kernels' heuristics size their grids for."""

import jax


def num_sms() -> int:
  """Streaming multiprocessors of the default device; 132 (an H100/H200) off the GPU, where only
  heuristics (split counts, the INT4 form) use it."""
  try:
    device = jax.devices()[0]
    if device.platform == "gpu":
      return int(device.core_count)
  except RuntimeError:  # no backend at all
    pass
  return 132
