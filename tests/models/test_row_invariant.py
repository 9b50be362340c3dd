"""``models/row_invariant.py``: on the CPU a bf16 row's reductions give the same bits whatever rows
are computed beside it, and the sums are right (against float64 numpy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import row_invariant


@pytest.mark.parametrize("n", [1, 2, 7, 384, 513])
def test_pinned_sum_is_the_sum(n):
  values = np.random.default_rng(n).normal(size=(5, n)).astype(np.float32)
  got = np.asarray(row_invariant.pinned_sum(jnp.asarray(values)))
  assert got.shape == (5, 1)
  np.testing.assert_allclose(got[:, 0], values.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


def _in_chunks(fn, rows, chunk):
  return np.concatenate([np.asarray(fn(rows[i:i + chunk])) for i in range(0, rows.shape[0], chunk)])


@pytest.mark.parametrize("chunk", [1, 8, 17])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(chunk):
  """408 rows at once against the same rows in chunks (decode steps are batch-sized, verify and
  prefill windows larger). XLA:CPU's own row reduction and dot fail this on an AVX2 host: the mean
  of squares differed in 151 of 384 rows between 8 and 4800 rows at once."""
  rng = np.random.default_rng(chunk)
  rows = jnp.asarray(rng.normal(scale=3.0, size=(17 * 8 * 3, 384)), jnp.bfloat16)
  router = jnp.asarray(rng.normal(scale=0.05, size=(384, 8)).astype(np.float32))
  scale = jax.jit(lambda x: row_invariant.rms_scale(x, 1e-5))
  logits = jax.jit(lambda x: row_invariant.small_matmul(x, router))
  for fn in (scale, logits):
    np.testing.assert_array_equal(_in_chunks(fn, rows, chunk), np.asarray(fn(rows)))
  x64 = np.asarray(rows.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(np.asarray(scale(rows))[:, 0], 1 / np.sqrt((x64 ** 2).mean(-1) + 1e-5), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(logits(rows)), x64 @ np.asarray(router, np.float64), rtol=1e-5, atol=1e-5)
