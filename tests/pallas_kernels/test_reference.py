"""The plain-jnp tree attention against a per-row float64 numpy loop (float32 inputs)."""

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import reference


def numpy_rows(q_lat, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid, scale):
  """Row by row: which columns a row sees, written out directly from the convention."""
  b, q, n, _ = q_lat.shape
  out = np.zeros(q_lat.shape, np.float64)
  for i in range(b):
    s, p = slots[i], prefix_len[i]
    for row in range(q):
      if valid[i, row]:
        cols = list(range(p)) + [p + j for j in range(q) if visibility[i, row, j] and valid[i, j]]
      else:
        cols = [p + row]
      cols = [c for c in cols if c < c_kv.shape[1]]  # a window past the pool: those columns are dropped
      if not cols:
        continue  # a row that sees nothing: 0
      kv, kr = c_kv[s, cols].astype(np.float64), k_pe[s, cols].astype(np.float64)
      for h in range(n):
        logits = (kv @ q_lat[i, row, h] + kr @ q_rope[i, row, h]) * scale
        w = np.exp(logits - logits.max())
        out[i, row, h] = (w / w.sum()) @ kv
  return out


def test_mla_reference_matches_row_by_row_numpy():
  rng = np.random.default_rng(0)
  b, q, n, r, p, slots_total, t = 3, 7, 2, 16, 4, 5, 40
  q_lat = rng.standard_normal((b, q, n, r)).astype(np.float32)
  q_rope = rng.standard_normal((b, q, n, p)).astype(np.float32)
  c_kv = rng.standard_normal((slots_total, t, r)).astype(np.float32)
  k_pe = rng.standard_normal((slots_total, t, p)).astype(np.float32)
  slots = np.array([4, 0, 2])
  prefix_len = np.array([0, 13, 30])
  visibility = rng.random((b, q, q)) < 0.5
  valid = rng.random((b, q)) < 0.7
  valid[:, 0] = True
  got = reference.mla_tree_attention(*map(jnp.asarray, (q_lat, q_rope, c_kv, k_pe, slots, prefix_len,
                                                         visibility, valid)), scale=0.3)
  want = numpy_rows(q_lat, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid, 0.3)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)


def test_window_past_the_pool_gives_zero_rows_not_nan():
  """A last prefill chunk may run past the pool (its write is dropped): padded rows whose own
  column lies past it see nothing and must be 0, finite like the kernels' (they were NaN)."""
  rng = np.random.default_rng(2)
  b, q, n, r, p, t = 2, 6, 2, 16, 4, 24
  q_lat, q_rope = rng.standard_normal((b, q, n, r)), rng.standard_normal((b, q, n, p))
  c_kv, k_pe = rng.standard_normal((3, t, r)), rng.standard_normal((3, t, p))
  slots, prefix_len = np.array([2, 0]), np.array([21, 5])  # request 0's window: columns 21..26
  visibility = np.tril(np.ones((b, q, q), bool))
  valid = np.array([[True, True, True, False, False, False], [True] * q])
  arrays = [np.asarray(x, np.float32) for x in (q_lat, q_rope, c_kv, k_pe)]
  got = np.asarray(reference.mla_tree_attention(*map(jnp.asarray, arrays), jnp.asarray(slots),
                                                jnp.asarray(prefix_len), jnp.asarray(visibility),
                                                jnp.asarray(valid), scale=0.3))
  want = numpy_rows(*arrays, slots, prefix_len, visibility, valid, 0.3)
  assert np.isfinite(got).all() and (got[0, 3:] == 0).all()
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_mha_reference_groups_heads_like_repeated_kv():
  rng = np.random.default_rng(1)
  b, q, n, g, d, t = 2, 5, 4, 2, 8, 20
  qs = rng.standard_normal((b, q, n, d)).astype(np.float32)
  k = rng.standard_normal((3, t, g, d)).astype(np.float32)
  v = rng.standard_normal((3, t, g, d)).astype(np.float32)
  args = (jnp.asarray([1, 2]), jnp.asarray([6, 11]), jnp.asarray(rng.random((b, q, q)) < 0.5),
          jnp.asarray(rng.random((b, q)) < 0.8))
  grouped = reference.mha_tree_attention(jnp.asarray(qs), jnp.asarray(k), jnp.asarray(v), *args, scale=0.5)
  rep = n // g
  full = reference.mha_tree_attention(jnp.asarray(qs), jnp.asarray(np.repeat(k, rep, axis=2)),
                                      jnp.asarray(np.repeat(v, rep, axis=2)), *args, scale=0.5)
  np.testing.assert_allclose(np.asarray(grouped), np.asarray(full), atol=1e-6)
  # A one-column row (padded row) returns exactly its own value vector.
  valid = np.asarray(args[3])
  for i, row in zip(*np.nonzero(~valid)):
    col = int(args[1][i]) + row
    np.testing.assert_allclose(np.asarray(grouped)[i, row], np.repeat(v[int(args[0][i]), col], rep, axis=0), atol=1e-6)


def _causal_chunks(attend, queries, pool, prefix: int, rows: int, chunk: int):
  """Rows [prefix, prefix + rows) of a causal prefill over ``pool`` (every row's key already
  written), computed in windows of ``chunk`` rows, as a chunked prefill runs them."""
  outs = []
  for start in range(prefix, prefix + rows, chunk):
    window = tuple(q[:, start:start + chunk] for q in queries)
    batch = window[0].shape[0]
    visibility = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), (batch, chunk, chunk))
    outs.append(attend(*window, *pool, jnp.arange(batch), jnp.full((batch,), start, jnp.int32), visibility,
                       jnp.ones((batch, chunk), bool)))
  return np.concatenate([np.asarray(o) for o in outs], axis=1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's codegen; GPU GEMMs choose kernels by shape")
def test_a_rows_output_does_not_depend_on_the_windows_length_on_the_cpu():
  """Bit for bit, a row's attention is the same in a window of 16 rows as in one of 32 (float32
  inputs; MLA at the demo target's widths, MHA at the drafter's): products in dot_general's own order keep
  XLA:CPU's products row-invariant (scores laid out [B, N, Q, T] or [B, G, R, Q, T] did not: every
  row differed), so a chunked prefill's logits do not depend on the chunk size
  (`benchmarks/bf16_noise.py`). Smaller windows may still round differently (docs/bf16_near_ties.md)."""
  rng = np.random.default_rng(4)
  batch, heads, pool_len, prefix, rows = 2, 6, 128, 32, 32
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  mla = jax.jit(lambda *a: reference.mla_tree_attention(*a, scale=0.1))
  queries, pool = (normal(batch, 96, heads, 128), normal(batch, 96, heads, 32)), (normal(batch, pool_len, 128),
                                                                                  normal(batch, pool_len, 32))
  np.testing.assert_array_equal(_causal_chunks(mla, queries, pool, prefix, rows, 16),
                                _causal_chunks(mla, queries, pool, prefix, rows, 32))
  mha = jax.jit(lambda *a: reference.mha_tree_attention(*a, scale=0.1))
  queries, pool = (normal(batch, 96, 6, 64),), (normal(batch, pool_len, 2, 64), normal(batch, pool_len, 2, 64))
  np.testing.assert_array_equal(_causal_chunks(mha, queries, pool, prefix, rows, 16),
                                _causal_chunks(mha, queries, pool, prefix, rows, 32))


def test_race_states_of_every_kernel_are_checked():
  """conftest records every interpreter race-detection state a test creates, not only the last."""
  from jax._src.pallas.mosaic_gpu.interpret import race_detection_state
  from tests.pallas_kernels import conftest
  first = race_detection_state.GPURaceDetectionState(num_cores=1)
  race_detection_state.GPURaceDetectionState(num_cores=1)  # a later kernel's, race-free
  assert not conftest.races_found()
  first.races_found = True
  assert conftest.races_found()
  first.races_found = False  # or this test's own teardown check would fail
