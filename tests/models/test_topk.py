"""models.topk.top_k against jax.lax.top_k and a numpy stable sort: the same values and the same ids,
ties included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import topk


def numpy_top_k(x: np.ndarray, k: int):
  """Largest first, equal values by lower index (a stable sort of the negated values)."""
  order = np.argsort(-x.astype(np.float64), axis=-1, kind="stable")[..., :k]
  return np.take_along_axis(x, order, axis=-1), order


@pytest.mark.parametrize("vocab,k,chunk", [
    (8192, 1, None), (8192, 5, None), (8192, 16, None), (1000, 7, 16), (1000, 7, 32), (777, 3, 50),
    (163840 // 64, 20, None), (300, 140, None), (64, 64, None)])
@pytest.mark.parametrize("levels", [None, 6, 300])
def test_equals_lax_top_k_and_numpy(vocab, k, chunk, levels):
  """Float32 rows without ties and with ties (values drawn from 6 levels, so every selection breaks
  ties by index, or from 300, so chunk maxima differ and tied values sit in chunks of different
  rank), -inf entries and a vocabulary that no chunk divides."""
  rng = np.random.default_rng(vocab * 100 + k)
  x = (rng.standard_normal((3, 4, vocab), np.float32) if levels is None
       else rng.integers(0, levels, size=(3, 4, vocab)).astype(np.float32))
  x[0, 0, rng.choice(vocab, vocab // 2, replace=False)] = -np.inf
  x[1, 2, :] = -np.inf  # a row of -inf only: ids 0..k-1
  values, ids = jax.jit(lambda x: topk.top_k(x, k, chunk))(jnp.asarray(x))
  ref_values, ref_ids = jax.lax.top_k(jnp.asarray(x), k)
  np_values, np_ids = numpy_top_k(x, k)
  assert ids.dtype == jnp.int32 and values.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_array_equal(np.asarray(values), np.asarray(ref_values))
  np.testing.assert_array_equal(np.asarray(ids), np_ids)
  np.testing.assert_array_equal(np.asarray(values), np_values)


def test_two_stage_form_is_used_and_matches_in_bfloat16():
  """At K2.6's vocabulary the default takes the two-stage form (a chunk of 256 for k = 5), and the
  bf16 logits' many exact ties come out as lax.top_k gives them."""
  assert topk.chunk_for(163840, 5) == 256 and topk.chunk_for(163840, 64) == 64
  assert topk.chunk_for(100, 60) == 0
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 163840), np.float32), jnp.bfloat16)
  values, ids = topk.top_k(x, 5)
  ref_values, ref_ids = jax.lax.top_k(x, 5)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_array_equal(np.asarray(values, np.float32), np.asarray(ref_values, np.float32))


def test_tied_value_in_a_lower_ranked_chunk_keeps_the_lower_id():
  """The tie order across chunks: 1.0 sits in chunk 0 (maximum 1) and chunk 1 (maximum 9); lax.top_k
  takes id 0, which a selection over chunks in rank order (chunk 1 first) would miss."""
  x = jnp.asarray([[1, 0, 0, 0, 1, 9, 0, 0] + [0] * 24], jnp.float32)
  values, ids = topk.top_k(x, 2, chunk=4)
  np.testing.assert_array_equal(np.asarray(ids[0]), [5, 0])
  np.testing.assert_array_equal(np.asarray(values[0]), [9, 1])


def test_chunk_holding_several_winners():
  """All k winners in one chunk (the case where the chunk maxima alone would pick the wrong ones)."""
  x = np.zeros((1, 4096), np.float32)
  x[0, 512:517] = [5, 4, 3, 2, 1]
  x[0, 2000] = 0.5
  values, ids = topk.top_k(jnp.asarray(x), 6, chunk=64)
  np.testing.assert_array_equal(np.asarray(ids[0]), [512, 513, 514, 515, 516, 2000])
  np.testing.assert_array_equal(np.asarray(values[0]), [5, 4, 3, 2, 1, 0.5])


@pytest.mark.parametrize("x,k,chunk,match", [
    (np.zeros((2, 10), np.float32), 0, None, r"k=0 must be in \[1, 10\]"),
    (np.zeros((2, 10), np.float32), 11, None, r"k=11 must be in \[1, 10\]"),
    (np.zeros((2, 10), np.int32), 2, None, "floating inputs"),
    (np.zeros((2, 10), np.float32), 2, -1, "chunk=-1"),
])
def test_bad_arguments_are_named(x, k, chunk, match):
  with pytest.raises(ValueError, match=match):
    topk.top_k(jnp.asarray(x), k, chunk)
