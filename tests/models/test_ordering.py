"""``models.ordering``: the sort-free stable orderings against ``lax.sort`` (int32 and float32 keys,
CPU; the GPU path is the same functions, selected by platform)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ordering


def _keys(rng, n):
  """Keys with heavy ties in every position: small ints, floats with both zeros, both NaNs and
  infinities among few values, and a small-int third key."""
  floats = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, -1.5, 2.25, -1e-30], np.float32)
  return (rng.integers(0, 2, n).astype(np.int32), rng.choice(floats, n), rng.integers(-3, 3, n).astype(np.int32))


@pytest.mark.parametrize("n", [1, 7, 256])
def test_pairwise_ranks_give_lax_sorts_stable_order(n):
  """The same permutation as ``lax.sort`` of the keys and an iota, for 1-3 keys."""
  rng = np.random.default_rng(n)
  for num_keys in (1, 2, 3):
    keys = tuple(jnp.asarray(k) for k in _keys(rng, n)[3 - num_keys:])
    want = np.asarray(jax.lax.sort((*keys, jnp.arange(n, dtype=jnp.int32)), num_keys=num_keys)[-1])
    ranks = np.asarray(jax.jit(ordering.pairwise_ranks)(*keys))
    np.testing.assert_array_equal(np.argsort(ranks), want)
    for count in {1, n}:
      np.testing.assert_array_equal(ordering.by_rank(jnp.asarray(ranks), count), want[:count])


def test_floats_order_as_lax_sort_canonicalises_them():
  """-0 and 0 tie (by index), every NaN ties with every NaN and sorts after +inf."""
  x = jnp.asarray(np.array([np.nan, 0.0, -np.nan, -0.0, -np.inf, 1.0, np.inf], np.float32))
  assert np.asarray(ordering.pairwise_ranks(x)).tolist() == [5, 1, 6, 2, 0, 3, 4]
  assert np.asarray(jnp.argsort(x, stable=True)).tolist() == [4, 1, 3, 5, 6, 0, 2]


@pytest.mark.parametrize("n, max_pairwise", [(9, 16), (40, 16)])
def test_stable_order_and_ranks_equal_argsort_on_either_path(monkeypatch, n, max_pairwise):
  """``stable_order`` / ``stable_ranks`` on the CPU's sort path and with the pairwise path forced
  (as on the GPU; past ``max_pairwise`` the sort in both): ``jnp.argsort(stable=True)`` and its inverse."""
  rng = np.random.default_rng(n)
  ids = jnp.asarray(rng.integers(0, 5, n).astype(np.int32))
  want = np.asarray(jnp.argsort(ids, stable=True))
  inverse = np.empty(n, np.int64)
  inverse[want] = np.arange(n)
  forced = []
  real = ordering._pairwise_on_gpu  # pylint: disable=protected-access

  def everywhere(n, max_pairwise, pairwise, sort):
    forced.append(n <= max_pairwise)
    return real(n, max_pairwise, pairwise, sort) if n > max_pairwise else pairwise()
  for patched in (False, True):
    if patched:
      monkeypatch.setattr(ordering, "_pairwise_on_gpu", everywhere)
    # a new function per trace: jax caches traces by the function
    order = jax.jit(lambda i: ordering.stable_order(i, max_pairwise=max_pairwise))(ids)
    first = jax.jit(lambda i: ordering.stable_order(i, count=3, max_pairwise=max_pairwise))(ids)
    ranks = jax.jit(lambda i: ordering.stable_ranks(i, max_pairwise=max_pairwise))(ids)
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(first, want[:3])
    np.testing.assert_array_equal(ranks, inverse)
  assert forced == [n <= max_pairwise] * 3


def test_the_gpu_lowering_has_no_sort_up_to_max_pairwise():
  def lowered(n):
    fn = jax.jit(lambda i: ordering.stable_order(i, max_pairwise=64))
    return fn.trace(jax.ShapeDtypeStruct((n,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.sort" not in lowered(64)
  assert "stablehlo.sort" in lowered(65)
  cpu = jax.jit(lambda i: ordering.stable_order(i, max_pairwise=64)).trace(
      jax.ShapeDtypeStruct((8,), jnp.int32)).lower(lowering_platforms=("cpu",)).as_text()
  assert "stablehlo.sort" in cpu
