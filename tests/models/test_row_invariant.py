"""``models/row_invariant.py``: on the CPU a bf16 row's reductions give the same bits whatever rows
are computed beside it, and the sums are right (against float64 numpy); with small batches padded,
a request decoded alone gets the bits it gets among others."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cache as cache_lib
from models import forward as fwd
from models import loading, row_invariant

# The forms and the padding are the CPU's (``jax.lax.platform_dependent``); a GPU keeps XLA's.
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="row invariance is the CPU's forms")


@pytest.mark.parametrize("n", [1, 2, 7, 384, 513])
def test_pinned_sum_is_the_sum(n):
  values = np.random.default_rng(n).normal(size=(5, n)).astype(np.float32)
  got = np.asarray(row_invariant.pinned_sum(jnp.asarray(values)))
  assert got.shape == (5, 1)
  np.testing.assert_allclose(got[:, 0], values.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


def _in_chunks(fn, rows, chunk):
  return np.concatenate([np.asarray(fn(rows[i:i + chunk])) for i in range(0, rows.shape[0], chunk)])


@cpu_only
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


def _greedy_logits(target, prompts, steps, max_len=96):
  """float32 logits [B, steps, V] of greedy decoding (prefill, then one decode step a token) of
  ``prompts`` as one batch, and the cache."""
  batch = len(prompts)
  with fwd.matmul_precision(target.cfg):
    cache = cache_lib.init_cache(target.cfg, batch, max_len)
    logits, _, _, cache = fwd.prefill(target, prompts, np.arange(batch), cache, chunk_size=16)
    logits, out = np.asarray(logits), []
    for _ in range(steps):
      token = jnp.asarray(np.argmax(logits, -1), jnp.int32)
      logits, _, cache = _decode(target, token, jnp.arange(batch, dtype=jnp.int32), cache)
      logits = np.asarray(logits)
      out.append(logits)
  return np.stack(out, 1), cache


_decode = jax.jit(fwd.decode_step)


@pytest.fixture(scope="module")
def bf16_demo_target():
  return loading.load_kimi("kimi-demo", dtype="bfloat16", param_dtype="bfloat16")


@cpu_only
def test_a_request_alone_decodes_the_bits_it_decodes_in_a_batch(bf16_demo_target):
  """bf16 on the CPU: the demo target's greedy logits for a prompt decoded alone (batch 1, one row a
  step, padded to ``MIN_CPU_BATCH``) are bit for bit those of the same prompt decoded among four
  (not padded), and so are its cache rows. Unpadded (``MIN_CPU_BATCH`` = 1) every step differed on
  the AVX2 host, by 0.09-0.10 and by 21.6 where a token flipped; checked, 2026-12-07."""
  held_out = json.loads((loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json").read_text())["prompts"]
  prompts = [p["tokens"][:length] for p, length in zip(held_out[:4], (40, 23, 31, 17))]
  together, together_cache = _greedy_logits(bf16_demo_target, prompts, steps=8)
  for i in (1, 3):
    alone, alone_cache = _greedy_logits(bf16_demo_target, [prompts[i]], steps=8)
    np.testing.assert_array_equal(alone[0], together[i])
    length = len(prompts[i]) + 8
    assert int(alone_cache.lengths[0]) == int(together_cache.lengths[i]) == length
    np.testing.assert_array_equal(np.asarray(alone_cache.c_kv[:, 0, :length].astype(jnp.float32)),
                                  np.asarray(together_cache.c_kv[:, i, :length].astype(jnp.float32)))
