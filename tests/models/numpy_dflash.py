"""An independent float64 numpy reference of one DFlash drafting forward (DESIGN §1.1).

Written from the formulas, deliberately unlike ``models/dflash.py``:

* one sequence, no batch, no cache and no mask: the caller passes exactly the context the block
  may see (its features and positions), so key rows are simply ``[context; block]``;
* keys and values of context and block come from ONE projection of the stacked rows
  ``[ctx; input_layernorm(block)]``;
* rotate-half RoPE as a complex rotation: ``x[i] + 1j * x[i + D/2]`` times
  ``exp(1j * position * theta**(-2i/D))``;
* attention head by head in a Python loop (query head n reads kv head ``n // (N / G)``);
* weights in HF layout (Linear ``[out, in]``) under the published names, all math in float64.

Semantics:
  ctx = rms(fc(concat_K features), hidden_norm)
  h = embed[[root, MASK, ..., MASK]] at positions start .. start + B - 1
  per layer: x = rms(h, input_layernorm); keys/values of [ctx; x] (k: k_proj, k_norm, rope);
             queries of x (q_proj, q_norm, rope); softmax(q k^T / sqrt(D)) v; h += o_proj(.)
             h += down(silu(gate(y)) * up(y)), y = rms(h, post_attention_layernorm)
  logits = rms(h, norm)[1:] @ lm_head^T
"""

from __future__ import annotations

import numpy as np

F64 = np.float64


def _f64(a) -> np.ndarray:
  return np.asarray(a).astype(F64)


def rms_norm(x, weight, eps: float) -> np.ndarray:
  x = _f64(x)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(weight)


def rope_inv_freq(cfg, d: int) -> np.ndarray:
  """float64 [d/2]: theta**(-2i/d), with YaRN (the paper's ramp between frequency / factor for
  slow pairs and the frequency itself for fast ones) where cfg.rope_factor > 1."""
  theta = cfg.rope_theta
  freq = theta ** (-2.0 * np.arange(d // 2, dtype=F64) / d)
  if cfg.rope_factor <= 1:
    return freq
  bound = lambda rotations: d * np.log(cfg.rope_original_max_position_embeddings / (rotations * 2 * np.pi)) / (
      2 * np.log(theta))
  low, high = max(np.floor(bound(cfg.rope_beta_fast)), 0), min(np.ceil(bound(cfg.rope_beta_slow)), d - 1)
  high = high + 0.001 if low == high else high
  interpolate = np.clip((np.arange(d // 2, dtype=F64) - low) / (high - low), 0, 1)
  return freq / cfg.rope_factor * interpolate + freq * (1 - interpolate)


def rope(x: np.ndarray, positions: np.ndarray, cfg) -> np.ndarray:
  """x [S, N, D] rotated at positions [S] (pairs i and i + D/2, as complex numbers), scaled by
  YaRN's attention factor where it is on."""
  d = x.shape[-1]
  half = d // 2
  z = x[..., :half] + 1j * x[..., half:]
  scale = cfg.rope_attention_factor if cfg.rope_factor > 1 else 1.0
  z = z * np.exp(1j * np.asarray(positions, F64)[:, None, None] * rope_inv_freq(cfg, d)[None, None, :]) * scale
  return np.concatenate([z.real, z.imag], axis=-1)


def _silu(x):
  return x / (1.0 + np.exp(-x))


def block_logits(state: dict, cfg, embed: np.ndarray, lm_head: np.ndarray, ctx_features: np.ndarray,
                 ctx_positions: np.ndarray, root: int, start: int) -> np.ndarray:
  """float64 logits [B - 1, V] of one block.

  Args:
    state: HF-named drafter tensors (``fc.weight``, ``layers.{i}.self_attn.q_proj.weight``, ...).
    cfg: the drafter's hyper-parameters (a DFlashConfig or anything with the same fields).
    embed: [V, H] the target's embedding; lm_head: [V, H] its head in HF layout.
    ctx_features: [T, K, H] target features of the context tokens the block sees (T may be 0).
    ctx_positions: [T] their absolute positions.
    root: token at ``start``.
  """
  w = {name: _f64(value) for name, value in state.items()}
  eps = cfg.rms_norm_eps
  n_heads, g_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  per_group = n_heads // g_heads
  feats = _f64(ctx_features)
  t = feats.shape[0]
  fused = feats.reshape(t, feats.shape[1] * feats.shape[2])  # [T, K * H], layer-major
  ctx = rms_norm(fused @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [T, H]

  size = cfg.block_size
  tokens = np.array([root] + [cfg.mask_token_id] * (size - 1))
  h = _f64(embed)[tokens]
  block_pos = start + np.arange(size)
  key_pos = np.concatenate([np.asarray(ctx_positions, np.int64), block_pos])

  for i in range(cfg.num_hidden_layers):
    p = f"layers.{i}."
    x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
    rows = np.concatenate([ctx, x], axis=0)  # [T + S, H]: context then block
    k = (rows @ w[p + "self_attn.k_proj.weight"].T).reshape(t + size, g_heads, d)
    k = rope(rms_norm(k, w[p + "self_attn.k_norm.weight"], eps), key_pos, cfg)
    v = (rows @ w[p + "self_attn.v_proj.weight"].T).reshape(t + size, g_heads, d)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(size, n_heads, d)
    q = rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], eps), block_pos, cfg)
    heads = []
    for n in range(n_heads):
      g = n // per_group
      scores = q[:, n, :] @ k[:, g, :].T / np.sqrt(d)  # [S, T + S]
      scores = scores - scores.max(axis=-1, keepdims=True)
      probs = np.exp(scores)
      probs /= probs.sum(axis=-1, keepdims=True)
      heads.append(probs @ v[:, g, :])
    h = h + np.concatenate(heads, axis=-1) @ w[p + "self_attn.o_proj.weight"].T
    y = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
    mlp = (_silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T))
    h = h + mlp @ w[p + "mlp.down_proj.weight"].T
  out = rms_norm(h, w["norm.weight"], eps)
  return out[1:] @ _f64(lm_head).T
