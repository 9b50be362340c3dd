"""An independent float64 numpy reference forward of the HF DeepSeek-V3 / Kimi K2 text decoder.

This is the oracle the JAX model is compared against, so it is deliberately written a different way:

* **Non-absorbed MLA.** Keys and values are expanded per head through ``kv_b_proj``
  (``k_nope``, ``v`` of every head) instead of attending in the latent space.
* **HF-style RoPE.** The rope dims of ``q_pe``/``k_pe`` are permuted from interleaved pairs to
  halves (``view(d/2, 2) -> transpose -> reshape``) and rotated with ``rotate_half`` against
  ``cat(freqs, freqs)`` tables, as HF ``modeling_deepseek`` does. The permuted layout is kept for
  both q and k, so the dot products equal those of a direct interleaved-pair rotation.
* **YaRN scales** are computed here from the raw cfg fields; ``KimiConfig.softmax_scale`` and
  ``KimiConfig.rope_cos_sin_scale`` are not used.
* Everything (norms, router, softmax, matmuls) runs in float64; weights of any dtype are upcast.

Semantics (DESIGN §2):
  h = embed[tokens]
  per layer: h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))
  logits = lm_head(norm(h))
MoE (noaux_tc, one group): scores = sigmoid(x @ gate.T); experts chosen by the top
``num_experts_per_tok`` of ``scores + e_score_correction_bias``; weights = the unbiased scores of the
chosen experts, normalised by (sum + 1e-20) when ``norm_topk_prob``, times
``routed_scaling_factor``; plus the shared expert. Every token is routed on its own (dropless).

**Top-k tie-break:** among equal biased scores the lowest expert id wins (a stable sort of the
negated scores). HF's ``torch.topk`` leaves tie order unspecified.

**Masks:** ``mask[i, j]`` True means query row i may attend to key column j. A row with no True
entry is rejected (softmax over nothing is NaN).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from models.config import KimiConfig

__all__ = [
    "forward",
    "expert_load",
    "init_random_state",
    "route",
    "rms_norm",
    "yarn_get_mscale",
    "yarn_correction_range",
    "yarn_linear_ramp",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rope_hf",
    "attn_softmax_scale",
    "mla_attention",
    "moe",
    "causal_mask",
]

F64 = np.float64


# ---------------------------------------------------------------------------------------------
# small pieces
# ---------------------------------------------------------------------------------------------
def _f64(a) -> np.ndarray:
  return np.asarray(a).astype(F64)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
  """x / sqrt(mean(x^2, -1) + eps) * weight, in float64."""
  x = _f64(x)
  inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return x * inv * _f64(weight)


def _sigmoid(x: np.ndarray) -> np.ndarray:
  # Overflow-safe logistic.
  out = np.empty_like(x)
  pos = x >= 0
  out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
  ex = np.exp(x[~pos])
  out[~pos] = ex / (1.0 + ex)
  return out


def _silu(x: np.ndarray) -> np.ndarray:
  return x * _sigmoid(x)


def _linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """HF nn.Linear without bias: weight is [out, in], y = x @ W.T."""
  return x @ _f64(w).T


def causal_mask(s: int) -> np.ndarray:
  return np.tril(np.ones((s, s), dtype=bool))


# ---------------------------------------------------------------------------------------------
# RoPE / YaRN (HF DeepseekV3YarnRotaryEmbedding, written from its formulas)
# ---------------------------------------------------------------------------------------------
def yarn_get_mscale(factor: float, mscale: float) -> float:
  """m(f, a) = 0.1 * a * ln(f) + 1, and 1 when f <= 1."""
  if factor <= 1.0:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


def _find_correction_dim(num_rotations: float, dim: int, base: float, orig_max_pos: int) -> float:
  return (dim * math.log(orig_max_pos / (num_rotations * 2.0 * math.pi))) / (2.0 * math.log(base))


def yarn_correction_range(cfg: KimiConfig) -> tuple[int, int]:
  """(low, high): floor(dim(beta_fast)), ceil(dim(beta_slow)), clamped into [0, dim - 1]."""
  dim = cfg.qk_rope_head_dim
  low = math.floor(_find_correction_dim(cfg.rope_beta_fast, dim, cfg.rope_theta,
                                        cfg.rope_original_max_position_embeddings))
  high = math.ceil(_find_correction_dim(cfg.rope_beta_slow, dim, cfg.rope_theta,
                                        cfg.rope_original_max_position_embeddings))
  return max(low, 0), min(high, dim - 1)


def yarn_linear_ramp(low: float, high: float, n: int) -> np.ndarray:
  """clip((arange(n) - low) / (high - low), 0, 1); high += 0.001 when low == high."""
  if low == high:
    high = high + 0.001
  return np.clip((np.arange(n, dtype=F64) - low) / (high - low), 0.0, 1.0)


def rope_inv_freq(cfg: KimiConfig) -> np.ndarray:
  """[qk_rope_head_dim // 2] inverse frequencies (YaRN-blended when rope_factor > 1)."""
  dim = cfg.qk_rope_head_dim
  exponents = np.arange(0, dim, 2, dtype=F64) / dim
  freq_extra = 1.0 / (cfg.rope_theta**exponents)
  if cfg.rope_factor <= 1.0:
    return freq_extra
  freq_inter = 1.0 / (cfg.rope_factor * cfg.rope_theta**exponents)
  low, high = yarn_correction_range(cfg)
  inv_freq_mask = 1.0 - yarn_linear_ramp(low, high, dim // 2)
  return freq_inter * (1.0 - inv_freq_mask) + freq_extra * inv_freq_mask


def _rope_mscale_ratio(cfg: KimiConfig) -> float:
  return yarn_get_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_get_mscale(
      cfg.rope_factor, cfg.rope_mscale_all_dim)


def rope_cos_sin(cfg: KimiConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """HF tables: emb = cat(freqs, freqs), cos/sin [S, dim] times the YaRN mscale ratio."""
  freqs = _f64(positions)[:, None] * rope_inv_freq(cfg)[None, :]
  emb = np.concatenate([freqs, freqs], axis=-1)
  ratio = _rope_mscale_ratio(cfg)
  return np.cos(emb) * ratio, np.sin(emb) * ratio


def _rotate_half(x: np.ndarray) -> np.ndarray:
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope_hf(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
  """HF DeepSeek rope on x [S, ..., d] with cos/sin [S, d].

  Permutes the last dim from interleaved pairs to halves, then x * cos + rotate_half(x) * sin.
  The result is in the permuted (halves) layout.
  """
  d = x.shape[-1]
  x = x.reshape(*x.shape[:-1], d // 2, 2)
  x = np.swapaxes(x, -1, -2).reshape(*x.shape[:-2], d)
  extra = x.ndim - cos.ndim
  shape = (cos.shape[0],) + (1,) * extra + (d,)
  c = cos.reshape(shape)
  s = sin.reshape(shape)
  return x * c + _rotate_half(x) * s


def attn_softmax_scale(cfg: KimiConfig) -> float:
  """(nope + rope)^-0.5 * m(factor, mscale_all_dim)^2."""
  scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)**-0.5
  if cfg.rope_factor > 1.0 and cfg.rope_mscale_all_dim:
    m = yarn_get_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    scale = scale * m * m
  return scale


# ---------------------------------------------------------------------------------------------
# attention (non-absorbed MLA)
# ---------------------------------------------------------------------------------------------
def mla_attention(get: Callable[[str], np.ndarray], p: str, cfg: KimiConfig, x: np.ndarray,
                  positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """One MLA block on already-normed x [S, H]; `p` is the 'model.layers.{i}.self_attn.' prefix."""
  s = x.shape[0]
  nh = cfg.num_attention_heads
  nope, rope, vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  eps = cfg.latent_norm_eps  # not rms_norm_eps: DeepSeek-V3's modeling code builds these two at 1e-6

  q = _linear(rms_norm(_linear(x, get(p + "q_a_proj.weight")), get(p + "q_a_layernorm.weight"), eps),
              get(p + "q_b_proj.weight"))
  q = q.reshape(s, nh, nope + rope)
  q_nope, q_pe = q[..., :nope], q[..., nope:]

  ckv = _linear(x, get(p + "kv_a_proj_with_mqa.weight"))
  compressed, k_pe = ckv[:, :cfg.kv_lora_rank], ckv[:, cfg.kv_lora_rank:]
  kv = _linear(rms_norm(compressed, get(p + "kv_a_layernorm.weight"), eps), get(p + "kv_b_proj.weight"))
  kv = kv.reshape(s, nh, nope + vdim)
  k_nope, v = kv[..., :nope], kv[..., nope:]

  cos, sin = rope_cos_sin(cfg, positions)
  q_pe = apply_rope_hf(q_pe, cos, sin)  # [S, nh, rope]
  k_pe = apply_rope_hf(k_pe, cos, sin)  # [S, rope], shared by every head

  scores = (np.einsum("qhd,khd->hqk", q_nope, k_nope) + np.einsum("qhd,kd->hqk", q_pe, k_pe))
  scores = scores * attn_softmax_scale(cfg)
  scores = np.where(mask[None, :, :], scores, -np.inf)
  scores = scores - scores.max(axis=-1, keepdims=True)
  probs = np.exp(scores)
  probs = probs / probs.sum(axis=-1, keepdims=True)
  out = np.einsum("hqk,khd->qhd", probs, v).reshape(s, nh * vdim)
  return _linear(out, get(p + "o_proj.weight"))


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------
def _dense_mlp(get, p: str, x: np.ndarray) -> np.ndarray:
  """down(silu(gate(x)) * up(x)); `p` ends with '.' (e.g. 'model.layers.0.mlp.')."""
  return _linear(_silu(_linear(x, get(p + "gate_proj.weight"))) * _linear(x, get(p + "up_proj.weight")),
                 get(p + "down_proj.weight"))


def route(x: np.ndarray, gate_weight: np.ndarray, correction_bias: np.ndarray,
          cfg: KimiConfig) -> tuple[np.ndarray, np.ndarray]:
  """noaux_tc routing of normed x [S, H]: (expert ids [S, k] int, weights [S, k] float64).

  Ids are ordered by biased score descending, lowest id first among ties.
  """
  scores = _sigmoid(_linear(x, gate_weight))  # [S, E], unbiased
  choice = scores + _f64(correction_bias)[None, :]
  k = cfg.num_experts_per_tok
  ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
  weights = np.take_along_axis(scores, ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
  weights = weights * cfg.routed_scaling_factor
  return ids, weights


def moe(get, p: str, cfg: KimiConfig, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """MoE block on normed x [S, H]; returns (output [S, H], chosen expert ids [S, k])."""
  ids, weights = route(x, get(p + "gate.weight"), get(p + "gate.e_score_correction_bias"), cfg)
  out = np.zeros_like(x)
  for e in np.unique(ids):
    rows, slots = np.nonzero(ids == e)
    y = _dense_mlp(get, f"{p}experts.{int(e)}.", x[rows])
    np.add.at(out, rows, weights[rows, slots][:, None] * y)
  if cfg.n_shared_experts > 0:
    out = out + _dense_mlp(get, p + "shared_experts.", x)
  return out, ids


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
def _prepare(cfg: KimiConfig, tokens, positions, mask):
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"tokens must be 1-D [S], got shape {tokens.shape}")
  s = tokens.shape[0]
  if np.any(tokens < 0) or np.any(tokens >= cfg.vocab_size):
    raise ValueError("token id outside the vocabulary")
  positions = np.arange(s) if positions is None else np.asarray(positions)
  if positions.shape != (s,):
    raise ValueError(f"positions must have shape ({s},), got {positions.shape}")
  mask = causal_mask(s) if mask is None else np.asarray(mask, dtype=bool)
  if mask.shape != (s, s):
    raise ValueError(f"mask must have shape ({s}, {s}), got {mask.shape}")
  if not mask.any(axis=-1).all():
    raise ValueError("every mask row needs at least one True entry (softmax over nothing is NaN)")
  return tokens, positions, mask


def _run(state, cfg: KimiConfig, tokens, positions, mask):
  tokens, positions, mask = _prepare(cfg, tokens, positions, mask)
  cache: dict[str, np.ndarray] = {}

  def get(name: str) -> np.ndarray:
    if name not in cache:
      if name not in state:
        raise KeyError(f"state lacks {name!r}")
      cache[name] = _f64(state[name])
    return cache[name]

  eps = cfg.rms_norm_eps
  h = get("model.embed_tokens.weight")[tokens]
  hidden, routing = [], []
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    h = h + mla_attention(get, p + "self_attn.", cfg, rms_norm(h, get(p + "input_layernorm.weight"), eps),
                          positions, mask)
    x = rms_norm(h, get(p + "post_attention_layernorm.weight"), eps)
    if i < cfg.first_k_dense_replace:
      h = h + _dense_mlp(get, p + "mlp.", x)
    else:
      y, ids = moe(get, p + "mlp.", cfg, x)
      h = h + y
      routing.append(ids)
    hidden.append(h)
  logits = _linear(rms_norm(h, get("model.norm.weight"), eps), get("lm_head.weight"))
  return logits, hidden, routing


def forward(state: dict[str, np.ndarray], cfg: KimiConfig, tokens: np.ndarray,
            positions: np.ndarray | None = None, mask: np.ndarray | None = None,
            return_hidden: bool = False):
  """float64 logits [S, V]; with return_hidden also the list of decoder-layer outputs [S, H].

  tokens int [S]; positions int [S] (default arange(S)); mask bool [S, S], True = may attend
  (default causal). Entry l of the hidden list is the output of decoder layer l (HF's
  ``hidden_states[l + 1]``), before the final norm.
  """
  logits, hidden, _ = _run(state, cfg, tokens, positions, mask)
  return (logits, hidden) if return_hidden else logits


def expert_load(state: dict[str, np.ndarray], cfg: KimiConfig, tokens: np.ndarray,
                positions: np.ndarray | None = None, mask: np.ndarray | None = None,
                valid: np.ndarray | None = None) -> np.ndarray:
  """int [num_moe_layers, n_routed_experts]: tokens routed to each expert in each MoE layer.

  `valid` (bool [S], optional) restricts the count to those rows (the forward itself is unchanged).
  """
  _, _, routing = _run(state, cfg, tokens, positions, mask)
  s = np.asarray(tokens).shape[0]
  keep = np.ones(s, dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
  load = np.zeros((cfg.num_moe_layers, cfg.n_routed_experts), dtype=np.int64)
  for layer, ids in enumerate(routing):
    np.add.at(load[layer], ids[keep].reshape(-1), 1)
  return load


def init_random_state(cfg: KimiConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """Random weights under the HF checkpoint names and layouts, float32 values."""
  rng = np.random.default_rng(seed)

  def linear(out_f: int, in_f: int) -> np.ndarray:
    return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)

  def norm(n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  H, V = cfg.hidden_size, cfg.vocab_size
  nh = cfg.num_attention_heads
  st: dict[str, np.ndarray] = {
      "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
      "model.norm.weight": norm(H),
      "lm_head.weight": linear(V, H),
  }
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    st[p + "input_layernorm.weight"] = norm(H)
    st[p + "post_attention_layernorm.weight"] = norm(H)
    a = p + "self_attn."
    st[a + "q_a_proj.weight"] = linear(cfg.q_lora_rank, H)
    st[a + "q_a_layernorm.weight"] = norm(cfg.q_lora_rank)
    st[a + "q_b_proj.weight"] = linear(nh * cfg.qk_head_dim, cfg.q_lora_rank)
    st[a + "kv_a_proj_with_mqa.weight"] = linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
    st[a + "kv_a_layernorm.weight"] = norm(cfg.kv_lora_rank)
    st[a + "kv_b_proj.weight"] = linear(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    st[a + "o_proj.weight"] = linear(H, nh * cfg.v_head_dim)
    m = p + "mlp."
    if i < cfg.first_k_dense_replace:
      f = cfg.intermediate_size
      st[m + "gate_proj.weight"] = linear(f, H)
      st[m + "up_proj.weight"] = linear(f, H)
      st[m + "down_proj.weight"] = linear(H, f)
    else:
      f = cfg.moe_intermediate_size
      st[m + "gate.weight"] = linear(cfg.n_routed_experts, H)
      st[m + "gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(cfg.n_routed_experts)).astype(
          np.float32)
      for e in range(cfg.n_routed_experts):
        ep = f"{m}experts.{e}."
        st[ep + "gate_proj.weight"] = linear(f, H)
        st[ep + "up_proj.weight"] = linear(f, H)
        st[ep + "down_proj.weight"] = linear(H, f)
      if cfg.n_shared_experts > 0:
        fs = f * cfg.n_shared_experts
        st[m + "shared_experts.gate_proj.weight"] = linear(fs, H)
        st[m + "shared_experts.up_proj.weight"] = linear(fs, H)
        st[m + "shared_experts.down_proj.weight"] = linear(H, fs)
  return st
