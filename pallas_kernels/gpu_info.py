"""Facts about the GPU the kernels' heuristics size their grids for, and how a call asks for the
CPU interpreter instead."""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


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


def interpret_params(interpret, name: str = "interpret"):
  """None (the GPU) or Mosaic GPU interpret-mode params; True (the usual Pallas idiom) takes their
  defaults and False means the GPU. Anything else is a TypeError naming ``name``."""
  if interpret is True:
    return plgpu.InterpretGPUParams()
  if interpret is False:  # also the usual Pallas spelling for "compiled"
    return None
  if interpret is not None and not isinstance(interpret, plgpu.InterpretGPUParams):
    raise TypeError(f"{name} must be None (GPU), True or plgpu.InterpretGPUParams, got {interpret!r}")
  return interpret


def pdl_prologue(pdl: bool, interpret) -> None:
  """A kernel's first statements under programmatic dependent launch (PDL): wait until the
  kernels before it have finished and their writes are visible (``griddepcontrol.wait``, so no
  read of an input can come before it), then let the next kernel launch (its CTAs take SMs as
  ours leave them and wait in this same prologue). Calling it marks the kernel's custom call for
  a launch with programmatic stream serialization, so its launch and set-up overlap the end of
  the kernel before it. Interpret mode runs kernels one after another: nothing to do there."""
  if pdl and interpret is None:
    plgpu.griddepcontrol_wait()
    plgpu.griddepcontrol_launch_dependents()
