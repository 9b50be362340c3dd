"""Plain-jnp tree-verify attention: the semantics every kernel must match.

A query window of ``Q`` rows (a draft tree, a prefill chunk, or one decode token) attends to
  * the committed prefix ``[0, prefix_len)`` of its request's cache slot, fully visible to real rows;
  * the window itself, written to ``[prefix_len, prefix_len + Q)`` before the call, through
    ``ddtree_jax.tree.window_mask(visibility, valid)`` (the one owner of the mask convention).
A padded row sees only itself (never the prefix). A padded row whose own column lies past the
pool (a last prefill chunk that runs past ``max_len``, whose write is dropped) sees nothing: its
output is 0, as the kernels store it, not the NaN of a softmax over nothing.

Every product keeps dot_general's own output order (batch dims, the queries' free dims, then the
keys'), any transpose after it. An output transposed inside the product lets XLA:CPU compute the
transposed product, whose free dimension is then the window's rows, and a row's value then
depends on how many rows the window has: every row of a 16-row chunk differed in its last bits
from the same row in a 32-row chunk, so the chunk size moved bf16 logits by 0.05 on average
(`benchmarks/results/bf16_noise_cpu.md`). In this order they are bit for bit the same. (Windows
of a few rows, or batches of one, can still round differently: XLA:CPU picks reduction orders by
shape there; `docs/bf16_near_ties.md`.)
"""

import jax
import jax.numpy as jnp

from ddtree_jax.tree import window_mask


def _masked_softmax(scores, mask):
  """Softmax over the last axis restricted to ``mask``; 0 for rows that see no column (NaN-free
  forward and backward)."""
  sees = jnp.any(mask, axis=-1, keepdims=True)
  probs = jax.nn.softmax(jnp.where(mask, scores, jnp.where(sees, -jnp.inf, 0.0)), axis=-1)
  return jnp.where(sees, probs, 0.0)


def cache_mask(prefix_len, visibility, valid, cache_len: int):
  """Which cache columns each window row may attend to.

  Args:
    prefix_len: int32[B], committed tokens per request.
    visibility: bool[B, Q, Q]; valid: bool[B, Q].
    cache_len: static number of cache columns T.
  Returns:
    bool[B, Q, T].
  """
  q_len = visibility.shape[-1]
  window = window_mask(visibility, valid)  # [B, Q, Q]
  col = jnp.arange(cache_len, dtype=jnp.int32)[None, :]  # [1, T]
  rel = col - prefix_len[:, None]  # [B, T]: window column index where 0 <= rel < Q
  in_window = (rel >= 0) & (rel < q_len)
  window_cols = jnp.take_along_axis(
      window, jnp.broadcast_to(jnp.clip(rel, 0, q_len - 1)[:, None, :], window.shape[:2] + (cache_len,)),
      axis=2)  # [B, Q, T]
  in_prefix = (rel < 0)[:, None, :] & valid[:, :, None]
  return in_prefix | (in_window[:, None, :] & window_cols)


def mla_tree_attention(q_latent, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid, *, scale):
  """Absorbed-MLA attention of a tree window over one layer's latent cache pool.

  Args:
    q_latent: [B, Q, N, R] queries already multiplied into the latent space (W_UK absorbed).
    q_rope: [B, Q, N, P] roped query parts.
    c_kv: [S, T, R] latent cache pool of this layer (all slots); k_pe: [S, T, P] roped keys.
    slots: int32[B] cache slot per request; prefix_len: int32[B] committed length per request.
    visibility: bool[B, Q, Q]; valid: bool[B, Q].
    scale: softmax scale.
  Returns:
    [B, Q, N, R] attention output in the latent space (float32).
  """
  kv = c_kv[slots].astype(jnp.float32)  # [B, T, R]
  kr = k_pe[slots].astype(jnp.float32)  # [B, T, P]
  scores = (jnp.einsum('bqnr,btr->bqnt', q_latent.astype(jnp.float32), kv) +
            jnp.einsum('bqnp,btp->bqnt', q_rope.astype(jnp.float32), kr)) * scale
  mask = cache_mask(prefix_len, visibility, valid, c_kv.shape[1])[:, :, None]  # [B, Q, 1, T]
  probs = _masked_softmax(scores, mask)
  return jnp.einsum('bqnt,btr->bqnr', probs, kv)


def mha_tree_attention(q, k, v, slots, prefix_len, visibility, valid, *, scale):
  """Grouped/multi-head attention of a tree window over one layer's K/V pool.

  Args:
    q: [B, Q, N, D]; k, v: [S, T, G, D] with N a multiple of G (grouped-query heads).
    slots, prefix_len, visibility, valid: as in ``mla_tree_attention``.
  Returns:
    [B, Q, N, D] float32.
  """
  num_heads, num_groups = q.shape[2], k.shape[2]
  if num_heads % num_groups:
    raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_groups}")
  rep = num_heads // num_groups
  kb = k[slots].astype(jnp.float32)  # [B, T, G, D]
  vb = v[slots].astype(jnp.float32)
  qg = q.astype(jnp.float32).reshape(q.shape[:2] + (num_groups, rep, q.shape[-1]))
  scores = jnp.einsum('bqgrd,btgd->bgqrt', qg, kb) * scale
  mask = cache_mask(prefix_len, visibility, valid, k.shape[1])[:, None, :, None]  # [B, 1, Q, 1, T]
  probs = _masked_softmax(scores, mask)
  out = jnp.einsum('bgqrt,btgd->bgqrd', probs, vb).transpose(0, 2, 1, 3, 4)  # [B, Q, G, R, D]
  return out.reshape(q.shape[:3] + (v.shape[-1],))
