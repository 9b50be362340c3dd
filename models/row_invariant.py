"""Reductions whose result for a row does not depend on how many rows are computed with it.

The lossless law compares speculative decoding, whose verify forward runs many rows at once, with
plain greedy decoding, which runs one row per request. In float32 the near-tie rule absorbs the
last-bit differences between the two; in bf16 it does not: one flipped bf16 rounding in a hidden
state moves the logits by ~0.1 a few layers on, far past the 1e-2 rule. On the XLA:CPU of an AVX2
host (2026-12-07) two of the target's reductions changed with the row count: the RMSNorm mean of
squares (a row reduction vectorised one way for up to 8 rows and another for 17 or more; and
``rsqrt``, whose vector and scalar code round differently) and the router's float32 product (a
dot blocked by the number of rows). With these forms the demo target's bf16 verify rows equal its
decode rows bit for bit there from 3 requests a call up; a call of fewer (a matrix-vector product
in the projections, a batched product of one or two entries in the reference attention) rounds
otherwise, so ``KimiModel`` runs bf16 batches of fewer than ``MIN_CPU_BATCH`` requests padded to
it on the CPU (``tests/models/test_row_invariant.py``, ``docs/bf16_near_ties.md``). On hosts with
AVX512-BF16 the plain forms happened to agree.

Only bf16 models on the CPU take these forms (``jax.lax.platform_dependent``; they cost a verify
step's compilation about 0.25 s, so float32 models, whose last-bit differences the float32 rule
absorbs, keep XLA's). On the GPU the products themselves (cuBLAS, the Pallas kernels) are where
rows part, so the GPU's bf16 gap (README) stays open, and the GPU keeps XLA's reduction and dot.
"""

import jax
import jax.numpy as jnp


def pinned_sum(values):
  """Sum over the last axis by halving with elementwise adds: [..., N] -> [..., 1].

  Each output's additions happen in one fixed order, whatever the other axes' sizes, because no
  reduction op is left for the compiler to vectorise or block. (An odd length carries its last
  column to the next round.)
  """
  while values.shape[-1] > 1:
    n, half = values.shape[-1], values.shape[-1] // 2
    pairs = values[..., :half] + values[..., half:2 * half]
    values = jnp.concatenate([pairs, values[..., 2 * half:]], axis=-1) if n % 2 else pairs
  return values


def _needs_invariance(dtype) -> bool:
  """Narrower than float32 (bf16): a float32 row's last-bit differences move the logits by ~1e-6,
  inside the float32 rule, so float32 models keep XLA's faster-to-compile reduction and dot."""
  return jnp.finfo(dtype).bits < 32


def rms_scale(x, eps: float):
  """1 / sqrt(mean(x^2) + eps) over the last axis of x (any float dtype), float32 [..., 1]: for bf16
  x on the CPU with ``pinned_sum`` and an IEEE sqrt and division (both correctly rounded in vector
  and scalar code)."""
  x32 = x.astype(jnp.float32)

  def default(x32):
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)

  if not _needs_invariance(x.dtype):
    return default(x32)

  def invariant(x32):
    return 1.0 / jnp.sqrt(pinned_sum(x32 * x32) / x32.shape[-1] + eps)

  return jax.lax.platform_dependent(x32, cpu=invariant, default=default)


def small_matmul(x, w):
  """float32 x [M, H] @ w [H, N] (a router's N logits): for bf16 x on the CPU each output as a
  ``pinned_sum`` of elementwise products ([M, N, H] of them: only for small N x H, as the CPU's
  models have); elsewhere a dot."""
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  if not _needs_invariance(x.dtype):
    return x32 @ w32

  def invariant(x32, w32):
    return pinned_sum(x32[:, None, :] * w32.T[None, :, :])[..., 0]

  return jax.lax.platform_dependent(x32, w32, cpu=invariant, default=lambda x32, w32: x32 @ w32)


# Batches of fewer requests than this run padded to it (bf16 on the CPU, ``KimiModel``). XLA:CPU
# computes a product with one row (a matrix-vector product) or a batched one with one or two batch
# entries (the reference attention's ``b``) in another order than with more: the bf16 demo target's
# decode rows at batch 1 and 2 differed from the same rows verified in one window, at batch 3 and up
# they were bit for bit the same (2026-12-07, AVX2 host). Four leaves a margin.
MIN_CPU_BATCH = 4


def pads_small_batches(dtype, batch: int) -> bool:
  """Whether a bf16 forward of ``batch`` requests runs with ``MIN_CPU_BATCH`` on the CPU (the
  caller pads under ``jax.lax.platform_dependent``, so the GPU runs the batch as it is)."""
  return _needs_invariance(dtype) and batch < MIN_CPU_BATCH
