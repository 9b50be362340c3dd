"""``tests/interpret_speedup.py`` changes how the interpreter's callbacks receive their arguments,
nothing else: the same outputs bit for bit, the same NaN for memory a kernel never wrote, the same
race reports, with the swap and with jax's own functions."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import race_detection_state
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tree_attention as ta
from tests import interpret_speedup

INTERPRET = plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)


@contextlib.contextmanager
def jax_as_shipped():
  interpret_speedup.uninstall()
  try:
    yield
  finally:
    interpret_speedup.install()


@pytest.fixture
def race_states(monkeypatch):
  states = []
  original = race_detection_state.GPURaceDetectionState.__init__

  def record(self, *args, **kwargs):
    original(self, *args, **kwargs)
    states.append(self)

  monkeypatch.setattr(race_detection_state.GPURaceDetectionState, "__init__", record)
  return states


def two_block_kernel(same_block: bool):
  """Two blocks each add their index to x[0:128] and store it: to their own half of the output
  (the other half of a block's 128 is never written: NaN), or both to the first half (a race)."""
  def body(x_gmem, o_gmem, smem, barrier):
    block = jax.lax.axis_index("x")
    plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(0, 128)], smem, barrier)
    plgpu.barrier_wait(barrier)
    smem[...] = smem[...] + block.astype(jnp.float32)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem.at[pl.ds(0 if same_block else block * 128, 128)])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((256,), jnp.float32), grid=(2,), grid_names=("x",),
                      scratch_types=[plgpu.SMEM((128,), jnp.float32), plgpu.Barrier(num_arrivals=1)],
                      interpret=INTERPRET,
                      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def test_installed_exactly_on_the_pinned_jax():
  assert interpret_speedup.installed() == (jax.__version__ == interpret_speedup.PINNED_JAX)
  assert jax.__version__ == interpret_speedup.PINNED_JAX  # constraints.txt pins it; else this file is moot


@pytest.mark.parametrize("same_block", [False, True])
def test_races_and_unwritten_memory_are_reported_as_without_the_swap(same_block, race_states):
  x = jnp.arange(256, dtype=jnp.float32)
  results = {}
  for label, context in (("swap", contextlib.nullcontext()), ("jax", jax_as_shipped())):
    with context:
      assert interpret_speedup.installed() == (label == "swap")
      start = len(race_states)
      out = np.asarray(two_block_kernel(same_block)(x))
      results[label] = out, any(state.races_found for state in race_states[start:])
  for out, raced in results.values():
    assert raced == same_block
    if same_block:  # either block's values may land last; the second half is never written
      assert np.isnan(out[128:]).all() and np.isin(out[:128] - np.arange(128), (0.0, 1.0)).all()
    else:
      np.testing.assert_array_equal(out, np.concatenate([np.arange(128), np.arange(128) + 1.0]))
  if not same_block:
    np.testing.assert_array_equal(results["swap"][0], results["jax"][0])


def test_a_tree_attention_call_is_bit_identical_without_the_swap():
  rng = np.random.default_rng(3)
  batch, q_len, heads, latent, rope, cache_len = 2, 5, 2, 64, 16, 150
  q_lat, q_rope = (jnp.asarray(rng.standard_normal((batch, q_len, heads, d)), jnp.float32) for d in (latent, rope))
  c_kv, k_pe = (jnp.asarray(rng.standard_normal((batch + 1, cache_len, d)), jnp.float32) for d in (latent, rope))
  slots, prefix_len = jnp.asarray([2, 0], jnp.int32), jnp.asarray([37, 140], jnp.int32)
  visibility = jnp.asarray(rng.random((batch, q_len, q_len)) < 0.5)
  valid = jnp.asarray([[True] * q_len, [True, True, False, True, False]])

  def call():
    return np.asarray(ta.mla_tree_attention(q_lat, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid,
                                            scale=0.1, interpret=INTERPRET, num_splits=2))

  swapped = call()
  with jax_as_shipped():
    shipped = call()
  assert np.isfinite(swapped).all() and np.abs(swapped).max() > 0
  np.testing.assert_array_equal(swapped, shipped)
