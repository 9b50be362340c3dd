"""Hand the Mosaic GPU interpreter's callbacks numpy arrays, not jax arrays (for the interpret-mode tests;
no other io_callback runs in this project, so the swap is installed suite-wide).

The interpreter runs a kernel as XLA:CPU code that calls back into Python (``io_callback``) for
every memory access, barrier and thread step: tens of thousands of calls per kernel launch in
``tests/pallas_kernels``. jax's ``io_callback_impl`` first moves each call's arguments (host
numpy buffers) onto the CPU device with ``jax.device_put``, which took most of the interpreter's
time (under cProfile, 26 of a 65 s MoE test went to ``device_put``, 15 s to the callbacks
themselves). The callbacks only read those arguments as host values, so a copy into a numpy
array serves them as well (a copy, not a view, because XLA may reuse the buffer once the call
returns). Two things in jax 0.11.2 need the swap:

- ``io_callback_impl`` itself, replaced by one that copies with ``np.array``;
- the interpreter's ``shared_memory._to_int``, which reads a scalar argument as an int and accepts
  only ``jax.Array``, tracers and ints; it now also accepts numpy scalars and 0-d arrays.

What the kernels compute, where the interpreter poisons memory and how it detects races are
unchanged: ``tests/test_interpret_speedup.py`` checks the kernels' outputs, an unwritten-memory
read and a real race with and without this module. Both pieces are private jax code, so the swap is made
only for the jax this project pins; any other version runs the interpreter as jax ships it.
"""

import numpy as np
import jax
from jax._src import callback as jax_callback
from jax._src import config as jax_config
from jax._src import tree_util
from jax._src import xla_bridge

PINNED_JAX = "0.11.2"

_ORIGINAL = {}


def _host_io_callback_impl(*args, result_avals, callback, sharding, ordered):
  """``io_callback_impl`` with the device_put of the arguments replaced by numpy copies."""
  del result_avals, sharding, ordered
  cpu_device, *_ = xla_bridge.local_devices(backend="cpu")
  with jax_config.default_device(cpu_device):
    return tree_util.tree_map(np.asarray, callback(*(np.array(a) for a in args)))


def _to_int(x):
  if isinstance(x, (np.ndarray, np.generic)):
    return x.item()
  return _ORIGINAL["_to_int"](x)


def install() -> bool:
  """Swap both functions in (idempotent); False, changing nothing, on another jax version."""
  if jax.__version__ != PINNED_JAX:
    return False
  from jax._src.pallas.mosaic_gpu.interpret import shared_memory
  if not _ORIGINAL:
    _ORIGINAL["io_callback_impl"] = jax_callback.io_callback_impl
    _ORIGINAL["_to_int"] = shared_memory._to_int
  jax_callback.io_callback_impl = _host_io_callback_impl
  shared_memory._to_int = _to_int
  return True


def uninstall() -> None:
  """Put jax's own functions back (for the tests that compare both)."""
  if _ORIGINAL:
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    jax_callback.io_callback_impl = _ORIGINAL["io_callback_impl"]
    shared_memory._to_int = _ORIGINAL["_to_int"]


def installed() -> bool:
  return jax_callback.io_callback_impl is _host_io_callback_impl
