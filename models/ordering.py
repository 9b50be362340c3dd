"""Stable lexicographic orderings of small sets without ``lax.sort`` on the GPU.

XLA's GPU sort writes in place: it first copies every operand into its output buffer, then runs a
few sorting kernels, so a step with many small sorts spends its time in copies and launches (the
DDTree search ran 31 sorts a step, the MoE block two a layer; ``docs/engine_step.md``). For a set
of n elements, comparing every pair is one fused compare-and-count kernel of n^2 work:
``rank[i] = #{j: key_j < key_i} + #{j < i: key_j == key_i}``, the element's place in the stable
sort. Up to a size (``max_pairwise``) that is cheaper than the sort; past it the sort stays. On the
CPU a sort is a cheap loop, so both functions sort there (``lax.platform_dependent``). Either way
the result is ``lax.sort``'s own order: floats compare as it compares them (-0 as 0, every NaN as
one NaN, after +inf), ties by index.
"""

import jax
import jax.numpy as jnp

# Sets larger than this sort on the GPU too (the pairs' n^2 work outgrows the sort).
MAX_PAIRWISE = 1024


def order_key(x):
  """int32 keys that order as ``lax.sort`` orders ``x`` (integers up to 32 bits, or floats)."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x.astype(jnp.int32)
  x = x.astype(jnp.float32)
  x = jnp.where(jnp.isnan(x), jnp.float32(jnp.nan), jnp.where(x == 0, jnp.float32(0), x))
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # negatives: larger magnitude first


def pairwise_ranks(*keys):
  """int32[n]: each element's place in the stable lexicographic sort of ``keys`` ([n] arrays, the
  first most significant), by comparing every pair (on any backend)."""
  index = jnp.arange(keys[0].shape[0])
  before = index[None, :] < index[:, None]  # [i, j]: on equal keys j comes first
  for key in reversed(keys):
    k = order_key(key)
    before = (k[None, :] < k[:, None]) | ((k[None, :] == k[:, None]) & before)
  return before.sum(1, dtype=jnp.int32)


def by_rank(ranks, count: int):
  """int32[count]: the indices of the elements of ranks 0 .. count - 1 (``ranks`` a permutation)."""
  return jnp.argmax(ranks[None, :] == jnp.arange(count, dtype=jnp.int32)[:, None], axis=1).astype(jnp.int32)


def _sorted_order(keys):
  return jax.lax.sort((*keys, jnp.arange(keys[0].shape[0], dtype=jnp.int32)), num_keys=len(keys))[-1]


def _pairwise_on_gpu(n: int, max_pairwise: int, pairwise, sort):
  if n > max_pairwise:
    return sort()
  return jax.lax.platform_dependent(cuda=pairwise, rocm=pairwise, default=sort)


def stable_order(*keys, count: int | None = None, max_pairwise: int = MAX_PAIRWISE):
  """int32[count]: the first ``count`` (default all) indices of the stable lexicographic sort of
  ``keys`` (1-D, one length), i.e. ``jnp.argsort(key, stable=True)`` for one key."""
  n = keys[0].shape[0]
  count = n if count is None else count
  return _pairwise_on_gpu(n, max_pairwise, lambda: by_rank(pairwise_ranks(*keys), count),
                          lambda: _sorted_order(keys)[:count])


def stable_ranks(*keys, max_pairwise: int = MAX_PAIRWISE):
  """int32[n]: each element's place in the stable lexicographic sort of ``keys`` (the inverse of
  ``stable_order``)."""
  n = keys[0].shape[0]

  def sort():
    return jnp.zeros(n, jnp.int32).at[_sorted_order(keys)].set(jnp.arange(n, dtype=jnp.int32))
  return _pairwise_on_gpu(n, max_pairwise, lambda: pairwise_ranks(*keys), sort)
