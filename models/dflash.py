"""DFlash block-diffusion drafter (DESIGN §1.1) in Flax NNX, and its engine adapter.

One drafter forward proposes a whole block: ``[root, MASK, ..., MASK]`` (``block_size`` B rows at
positions ``start .. start + B - 1``) attends bidirectionally to itself and to a per-request
context made of the target's features of every committed token; the target's LM head on rows
1..B-1 gives L = B - 1 per-position distributions (row k predicts the token at ``start + k``).

  * Context: ``ctx = hidden_norm(fc(concat_K(h_l)))`` from the outputs of the target decoder
    layers ``target_layer_ids`` (0-based: id l is the output of decoder layer l).
  * KV injection: every layer projects ``ctx`` with its own ``k_proj``/``v_proj``/``k_norm`` (the
    ones it applies to the block), ropes the keys at their absolute positions and prepends them to
    the block's keys/values. Only these context K/V persist (``DFlashCache``); block K/V are
    recomputed every round.
  * Layers are Qwen3-style (pre-norm, GQA with per-head q/k RMSNorm, SwiGLU), rotate-half RoPE with
    the drafter's own theta. There is no embedding and no LM head: the target's are used (shared).

Training (``train_block_logits``/``train_loss``) runs many anchors of a sequence in one forward;
because blocks never see each other, a block is computed exactly as at inference: it is the same
``_run_blocks`` with a per-block context mask (``t < anchor``) instead of ``t < length``.

Axis letters in einsums: b batch, a block (anchor), s block row, u block column, t context column,
g kv head, r query head within its group, d head dim, h hidden, n flattened rows, v vocabulary.
"""

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import topk
from models.cache import SlotPooled
from models.config import ConfigError, KimiConfig, rope_scaling_fields, rope_theta_field, yarn_mscale
from models.kimi import RMSNorm, yarn_inv_freq_of

_DTYPES = ("float32", "bfloat16", "float16")
# DESIGN §1.1: loss weight exp(-(k - 1) / gamma) per block size.
_DEFAULT_LOSS_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
ARCHITECTURE = "DFlashDraftModel"


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
def default_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
  """DFlash's default feature layers (DESIGN §1.1), 0-based decoder-layer ids.

  ``[T // 2]`` for K = 1, else ``round(1 + i * (T - 4) / (K - 1))`` for i < K (Python ``round``),
  spread over ``[1, T - 3]``. Ids are clamped into ``[0, T - 1]`` (only shallow targets, T <= 4,
  need it) and duplicates dropped (they occur only when K > T - 3), so fewer than K may come back.
  """
  t, k = num_target_layers, num_features
  if not isinstance(t, int) or t <= 0 or not isinstance(k, int) or k <= 0:
    raise ConfigError(f"default_target_layer_ids needs positive ints, got T={t!r}, K={k!r}")
  ids = [t // 2] if k == 1 else [round(1 + i * (t - 4) / (k - 1)) for i in range(k)]
  return tuple(sorted({min(max(int(i), 0), t - 1) for i in ids}))


def default_loss_gamma(block_size: int) -> float:
  if block_size not in _DEFAULT_LOSS_GAMMA:
    raise ConfigError(f"no default loss gamma for block_size {block_size} (known: "
                      f"{sorted(_DEFAULT_LOSS_GAMMA)}); set DFlashConfig.loss_gamma or pass gamma=")
  return _DEFAULT_LOSS_GAMMA[block_size]


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Every dimension and constant of a DFlash drafter for one target.

  ``hidden_size`` and ``vocab_size`` are the target's (the drafter reads the target's features
  and uses its embedding and LM head); ``target_num_hidden_layers`` is the target's depth T.
  ``target_layer_ids`` defaults to ``default_target_layer_ids(T, num_hidden_layers)``.
  """

  hidden_size: int
  vocab_size: int
  target_num_hidden_layers: int
  num_hidden_layers: int = 5
  num_attention_heads: int = 32
  num_key_value_heads: int = 8
  head_dim: int = 128
  intermediate_size: int = 12288
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  # YaRN (rope_scaling "yarn", as the published Kimi K2.5/K2.6 drafters use): factor 1 is plain
  # RoPE. The pairs' frequencies follow the target's YaRN formula on the drafter's head_dim; cos
  # and sin are multiplied by rope_attention_factor (the softmax scale stays head_dim**-0.5).
  rope_factor: float = 1.0
  rope_original_max_position_embeddings: int = 4096
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_attention_factor: float = 1.0
  block_size: int = 16
  target_layer_ids: tuple[int, ...] | None = None
  mask_token_id: int = 0
  loss_gamma: float | None = None  # None: the DESIGN default of block_size (16: 7, 10: 5, 8: 4)
  initializer_range: float = 0.02
  dtype: str = "bfloat16"
  param_dtype: str = "bfloat16"

  def __post_init__(self):
    ids = self.target_layer_ids
    if ids is None:
      if (isinstance(self.target_num_hidden_layers, int) and self.target_num_hidden_layers > 0 and
          isinstance(self.num_hidden_layers, int) and self.num_hidden_layers > 0):
        ids = default_target_layer_ids(self.target_num_hidden_layers, self.num_hidden_layers)
      else:
        ids = ()
    elif isinstance(ids, (list, tuple)):
      # Plain ints (numpy ints from a loaded file included), as a tuple: the config stays hashable.
      ids = tuple(int(i) if isinstance(i, np.integer) else i for i in ids)
    object.__setattr__(self, "target_layer_ids", ids)
    self.validate()

  @property
  def num_features(self) -> int:
    """K: target layers fused into the context."""
    return len(self.target_layer_ids)

  @property
  def num_positions(self) -> int:
    """L = block_size - 1 predicted positions per block."""
    return self.block_size - 1

  @property
  def gamma(self) -> float:
    return self.loss_gamma if self.loss_gamma is not None else default_loss_gamma(self.block_size)

  def validate(self) -> None:
    positive = ["hidden_size", "vocab_size", "target_num_hidden_layers", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"]
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"DFlashConfig.{name} must be a positive int, got {value!r}")
    if not isinstance(self.block_size, int) or self.block_size < 2:
      raise ConfigError(f"DFlashConfig.block_size must be an int >= 2 (root + at least one MASK), "
                        f"got {self.block_size!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ConfigError(f"DFlashConfig.num_attention_heads={self.num_attention_heads} is not a multiple "
                        f"of num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"DFlashConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    ids, t = self.target_layer_ids, self.target_num_hidden_layers
    if not isinstance(ids, tuple) or not ids:
      raise ConfigError(f"DFlashConfig.target_layer_ids must be a non-empty list of layer ids, got {ids!r}")
    for layer_id in ids:
      if not isinstance(layer_id, (int, np.integer)) or isinstance(layer_id, bool) or not 0 <= layer_id < t:
        raise ConfigError(f"DFlashConfig.target_layer_ids {list(ids)}: id {layer_id!r} outside [0, {t}) "
                          f"(0-based decoder-layer ids of a {t}-layer target)")
    if len(set(ids)) != len(ids):
      raise ConfigError(f"DFlashConfig.target_layer_ids {list(ids)} repeat a layer")
    if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
      raise ConfigError(f"DFlashConfig.mask_token_id={self.mask_token_id!r} outside the vocabulary "
                        f"[0, {self.vocab_size})")
    for name in ("rms_norm_eps", "rope_theta", "rope_factor", "rope_beta_fast", "rope_beta_slow",
                 "rope_attention_factor", "rope_original_max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"DFlashConfig.{name} must be > 0, got {value!r}")
    if self.loss_gamma is not None and not (isinstance(self.loss_gamma, (int, float)) and self.loss_gamma > 0):
      raise ConfigError(f"DFlashConfig.loss_gamma must be > 0 or None, got {self.loss_gamma!r}")
    if not isinstance(self.initializer_range, (int, float)) or self.initializer_range < 0:
      raise ConfigError(f"DFlashConfig.initializer_range must be >= 0, got {self.initializer_range!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ConfigError(f"DFlashConfig.{name}={getattr(self, name)!r}: expected one of {_DTYPES}")

  def replace(self, **changes) -> "DFlashConfig":
    return dataclasses.replace(self, **changes)

  def check_target(self, target_cfg: KimiConfig) -> None:
    """Raises ConfigError unless this drafter fits ``target_cfg``."""
    for ours, theirs in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
                         ("target_num_hidden_layers", "num_hidden_layers")):
      if getattr(self, ours) != getattr(target_cfg, theirs):
        raise ConfigError(f"DFlashConfig.{ours}={getattr(self, ours)} does not match the target's "
                          f"{theirs}={getattr(target_cfg, theirs)}")

  # ---- presets ---------------------------------------------------------------------------
  @classmethod
  def _target_fields(cls, target_cfg: KimiConfig) -> dict:
    # The mask token is the last id of the vocabulary: for Kimi that is the last of the reserved
    # special ids 163584..163839, which never occurs in text (override for a trained checkpoint).
    return dict(hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
                target_num_hidden_layers=target_cfg.num_hidden_layers,
                mask_token_id=target_cfg.vocab_size - 1, rms_norm_eps=target_cfg.rms_norm_eps,
                dtype=target_cfg.dtype, param_dtype=target_cfg.param_dtype)

  @classmethod
  def tiny(cls, target_cfg: KimiConfig, **overrides) -> "DFlashConfig":
    """Two small layers for ``KimiConfig.tiny()`` (seconds on a CPU).

    rope_theta is 1e4 rather than 1e6 so that every rotary pair turns measurably over the few
    hundred positions tests use.
    """
    fields = cls._target_fields(target_cfg)
    fields.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, rope_theta=1e4, block_size=16, initializer_range=0.1)
    fields.update(overrides)
    return cls(**fields)

  @classmethod
  def for_target(cls, target_cfg: KimiConfig, **overrides) -> "DFlashConfig":
    """The default drafter for a target: 5 layers, head_dim 128, ``hidden // 128`` query heads,
    gcd(8, heads) KV heads, the target's dense MLP width, block 16, rope_theta 1e6.

    For Kimi K2.6: 56 heads, 8 KV heads, width 18432, features of layers (1, 15, 30, 44, 58).
    """
    fields = cls._target_fields(target_cfg)
    heads = max(1, target_cfg.hidden_size // 128)
    fields.update(num_hidden_layers=5, num_attention_heads=heads, num_key_value_heads=math.gcd(8, heads),
                  head_dim=128, intermediate_size=target_cfg.intermediate_size, rope_theta=1e6, block_size=16,
                  initializer_range=target_cfg.initializer_range)
    fields.update(overrides)
    return cls(**fields)

  # ---- HF config.json (published DFlash layout) ---------------------------------------------
  @classmethod
  def from_hf(cls, config: Mapping[str, Any], **overrides) -> "DFlashConfig":
    """Reads a DFlash ``config.json`` dict: Qwen3 fields at the top level, ``target_layer_ids``,
    ``mask_token_id`` and ``block_size`` under ``dflash_config`` (top level also accepted),
    ``num_target_layers``; ``rope_theta`` at the top level or under ``rope_parameters``."""
    if not isinstance(config, Mapping):
      raise ConfigError(f"from_hf expects a config.json dict, got {type(config).__name__}")
    archs = config.get("architectures")
    if archs is not None and ARCHITECTURE not in archs:
      raise ConfigError(f"config.json architectures={archs}: expected [{ARCHITECTURE!r}]")
    nested = config.get("dflash_config") or {}
    if not isinstance(nested, Mapping):
      raise ConfigError("config.json's dflash_config is not a dict")

    def pick(name):
      inner, outer = nested.get(name), config.get(name)
      if inner is not None and outer is not None and inner != outer:  # which one a reader takes varies
        raise ConfigError(f"config.json {name}={outer!r} and dflash_config.{name}={inner!r} disagree")
      return inner if inner is not None else outer

    fields: dict[str, Any] = {}
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    missing = [k for k in required if config.get(k) is None and k not in overrides]
    if config.get("num_target_layers") is None and "target_num_hidden_layers" not in overrides:
      missing.append("num_target_layers")
    if pick("mask_token_id") is None and "mask_token_id" not in overrides:
      missing.append("dflash_config.mask_token_id")
    if missing:
      raise ConfigError(f"config.json lacks {', '.join(missing)} (not a DFlash drafter config?)")
    for name in required:
      if config.get(name) is not None:
        fields[name] = config[name]
    if config.get("num_target_layers") is not None:
      fields["target_num_hidden_layers"] = config["num_target_layers"]
    heads = config.get("num_attention_heads")
    fields["num_key_value_heads"] = config.get("num_key_value_heads") or heads
    if config.get("head_dim") is not None:
      fields["head_dim"] = config["head_dim"]
    elif heads:
      fields["head_dim"] = config["hidden_size"] // heads
    for name in ("rms_norm_eps", "initializer_range"):
      if config.get(name) is not None:
        fields[name] = config[name]
    theta = rope_theta_field(config)
    if theta is not None:
      fields["rope_theta"] = float(theta)
    fields.update(_yarn_fields(config))
    if config.get("attention_bias"):
      raise ConfigError("config.json attention_bias=true: DFlash projections have no bias")
    if config.get("hidden_act", "silu") != "silu":
      raise ConfigError(f"config.json hidden_act={config['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if config.get("use_sliding_window"):
      raise ConfigError("config.json use_sliding_window=true: sliding-window drafters are not supported")
    sliding = [i for i, kind in enumerate(config.get("layer_types") or []) if kind != "full_attention"]
    if sliding:
      raise ConfigError(f"config.json layer_types: layer {sliding[0]} is {config['layer_types'][sliding[0]]!r}; "
                        "sliding-window drafter layers are not supported")
    for name in ("target_layer_ids", "mask_token_id", "block_size", "loss_gamma"):
      if pick(name) is not None:
        fields[name] = tuple(pick(name)) if name == "target_layer_ids" else pick(name)
    dtype = config.get("torch_dtype", config.get("dtype"))
    if dtype in _DTYPES:
      fields.update(dtype=dtype, param_dtype=dtype)
    fields.update(overrides)
    return cls(**fields)

  def to_hf(self) -> dict:
    """The ``config.json`` dict in the published DFlash layout (``block_size`` at the top level,
    where the published model code reads it, and under ``dflash_config`` too)."""
    nested = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
              "block_size": self.block_size}
    if self.loss_gamma is not None:
      nested["loss_gamma"] = self.loss_gamma
    scaling = {} if self.rope_factor <= 1.0 else {"rope_scaling": {
        "rope_type": "yarn", "factor": self.rope_factor,
        "original_max_position_embeddings": self.rope_original_max_position_embeddings,
        "beta_fast": self.rope_beta_fast, "beta_slow": self.rope_beta_slow,
        "attention_factor": self.rope_attention_factor}}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": self.hidden_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "intermediate_size": self.intermediate_size,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "vocab_size": self.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": self.initializer_range,
        "torch_dtype": self.param_dtype,
        "num_target_layers": self.target_num_hidden_layers,
        "block_size": self.block_size,
        "dflash_config": nested,
        **scaling,
    }


def _yarn_fields(config: Mapping[str, Any]) -> dict:
  """DFlashConfig's YaRN fields from an HF config (none for plain RoPE). Without an explicit
  ``attention_factor``, transformers' rule: m(f, mscale) / m(f, mscale_all_dim) where both are
  given (1 for the published Kimi drafters), else 0.1 ln f + 1. Older transformers and vLLM used
  0.1 ln f + 1 for those drafters too (1.416 at factor 64): pass ``rope_attention_factor`` to
  ``load_dflash`` to choose it."""
  scaling = rope_scaling_fields(config)
  if not scaling:
    return {}
  source = scaling.pop("_source")
  for key in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "original_max_position_embeddings"):
    value = scaling.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise ConfigError(f"config.json {source}.{key} must be a number, got {value!r}")
  factor = float(scaling["factor"])
  attention = scaling.get("attention_factor")
  if attention is None:
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                 else yarn_mscale(factor, 1.0))
  original = scaling["original_max_position_embeddings"]  # rope_scaling_fields requires it
  if original != int(original):
    raise ConfigError(f"config.json {source}.original_max_position_embeddings must be an int, got {original!r}")
  return dict(rope_factor=factor, rope_original_max_position_embeddings=int(original),
              rope_beta_fast=float(scaling.get("beta_fast") or 32), rope_beta_slow=float(scaling.get("beta_slow") or 1),
              rope_attention_factor=float(attention))


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def _linear(cfg: DFlashConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)


def apply_rope(x, positions, cfg: DFlashConfig):
  """Rotate-half RoPE: pair (i, i + D/2) turns by ``position * inv_freq[i]``, ``theta**(-2i/D)``
  (YaRN-corrected where ``cfg.rope_factor`` > 1, cos and sin then times the attention factor).

  Args:
    x: [..., S, N, D]; positions: int32[..., S].
  Returns:
    Same shape and dtype (computed in float32).
  """
  half = x.shape[-1] // 2
  inv_freq = yarn_inv_freq_of(x.shape[-1], cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_position_embeddings,
                              cfg.rope_beta_fast, cfg.rope_beta_slow)  # [D/2]
  scale = cfg.rope_attention_factor if cfg.rope_factor > 1.0 else 1.0
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., S, D/2]
  cos, sin = (jnp.cos(angles) * scale)[..., None, :], (jnp.sin(angles) * scale)[..., None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class DFlashAttention(nnx.Module):
  """GQA with per-head q/k RMSNorm; keys/values = [context (cached)] + [block (recomputed)]."""

  def __init__(self, cfg: DFlashConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    n, g, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    self.q_proj = _linear(cfg, h, n * d, rngs)
    self.k_proj = _linear(cfg, h, g * d, rngs)
    self.v_proj = _linear(cfg, h, g * d, rngs)
    self.o_proj = _linear(cfg, n * d, h, rngs)
    self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.param_dtype)
    self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.param_dtype)

  def keys_values(self, x, positions):
    """The keys (normed, roped) and values of rows ``x``: context rows or block rows alike.

    Args:
      x: [..., S, H]; positions: int32[..., S].
    Returns:
      (k, v), each [..., S, G, D].
    """
    cfg = self.cfg
    split = x.shape[:-1] + (cfg.num_key_value_heads, cfg.head_dim)
    k = apply_rope(self.k_norm(self.k_proj(x).reshape(split)), positions, cfg)
    return k, self.v_proj(x).reshape(split)

  def __call__(self, x, positions, ctx_k, ctx_v, ctx_visible):
    """Blocks attend to their context columns and, bidirectionally, to their own rows.

    Args:
      x: [B, A, S, H] normed block hidden states (A blocks per batch row).
      positions: int32[B, A, S].
      ctx_k, ctx_v: [B, T, G, D] context keys/values (keys already normed and roped).
      ctx_visible: bool[B, A, T], which context columns each block sees.
    Returns:
      [B, A, S, H].
    """
    cfg = self.cfg
    b, a, s, _ = x.shape
    n, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = apply_rope(self.q_norm(self.q_proj(x).reshape(b, a, s, n, d)), positions, cfg)
    q = q.reshape(b, a, s, g, n // g, d)  # query head g * R + r reads kv head g (HF repeat_kv)
    k, v = self.keys_values(x, positions)  # [B, A, S, G, D]
    ctx_k, ctx_v = ctx_k.astype(q.dtype), ctx_v.astype(q.dtype)
    scale = d**-0.5
    f32 = jnp.float32
    s_ctx = jnp.einsum('basgrd,btgd->bagrst', q, ctx_k, preferred_element_type=f32) * scale
    s_blk = jnp.einsum('basgrd,baugd->bagrsu', q, k, preferred_element_type=f32) * scale
    s_ctx = jnp.where(ctx_visible[:, :, None, None, None, :], s_ctx, -jnp.inf)
    # One softmax over [context | block]: every row sees its whole block, so no row is all-masked.
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    p_ctx, p_blk = probs[..., :ctx_k.shape[1]], probs[..., ctx_k.shape[1]:]
    out = (jnp.einsum('bagrst,btgd->basgrd', p_ctx.astype(v.dtype), ctx_v, preferred_element_type=f32) +
           jnp.einsum('bagrsu,baugd->basgrd', p_blk.astype(v.dtype), v, preferred_element_type=f32))
    return self.o_proj(out.reshape(b, a, s, n * d).astype(x.dtype))


class DFlashMLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: DFlashConfig, rngs: nnx.Rngs):
    self.gate_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
    self.up_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
    self.down_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nnx.Module):

  def __init__(self, cfg: DFlashConfig, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.self_attn = DFlashAttention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.mlp = DFlashMLP(cfg, rngs)

  def __call__(self, x, positions, ctx_k, ctx_v, ctx_visible):
    x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, ctx_visible)
    return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nnx.Module):
  """``fc`` + ``hidden_norm`` (context fusion), stacked Qwen3-style layers, final ``norm``.

  No embedding and no LM head: the target's are passed in (``DFlashParams``).
  """

  def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.fc = _linear(cfg, cfg.num_features * cfg.hidden_size, cfg.hidden_size, rngs)
    self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs):
      return DFlashLayer(cfg, layer_rngs)

    self.layers = make(rngs)  # every parameter carries a leading [num_hidden_layers] axis
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)


def init_dflash(cfg: DFlashConfig, seed: int = 0) -> DFlashModel:
  return DFlashModel(cfg, rngs=nnx.Rngs(seed))


def abstract_dflash(cfg: DFlashConfig) -> DFlashModel:
  """Shapes and dtypes only, no allocation."""
  return nnx.eval_shape(lambda: DFlashModel(cfg, rngs=nnx.Rngs(0)))


def _scan_layers(model: DFlashModel, body, carry, xs):
  """``lax.scan`` of ``body(layer, carry, x) -> (carry, y)`` over the stacked layers."""
  graphdef, state = nnx.split(model.layers)

  def step(carry, inputs):
    layer_state, x = inputs
    return body(nnx.merge(graphdef, layer_state), carry, x)

  return jax.lax.scan(step, carry, (state, xs))


# ---------------------------------------------------------------------------------------------
# Context cache
# ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashCache(SlotPooled):
  """Per-slot context keys/values (the drafter's only persistent state).

  Attributes:
    k: [layers, num_slots + 1, max_len, kv_heads, head_dim], normed and roped.
    v: [layers, num_slots + 1, max_len, kv_heads, head_dim].
    lengths: int32[num_slots + 1], context tokens per slot; the last slot is scratch (batch rows
      without a request point at it and never advance it).
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array


def init_cache(cfg: DFlashConfig, num_slots: int, max_len: int, dtype=None) -> DFlashCache:
  if num_slots <= 0 or max_len <= 0:
    raise ValueError(f"init_cache: num_slots={num_slots} and max_len={max_len} must be positive")
  shape = (cfg.num_hidden_layers, num_slots + 1, max_len, cfg.num_key_value_heads, cfg.head_dim)
  dtype = jnp.dtype(dtype or cfg.dtype)
  return DFlashCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                     lengths=jnp.zeros((num_slots + 1,), jnp.int32))


# ---------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------
def fuse_context(model: DFlashModel, features):
  """``hidden_norm(fc(concat_K(features)))``.

  Args:
    features: [B, Q, K, H], the target's outputs of decoder layers ``target_layer_ids`` (in order).
  Returns:
    [B, Q, H].
  """
  cfg = model.cfg
  b, q, k, h = features.shape
  if (k, h) != (cfg.num_features, cfg.hidden_size):
    raise ValueError(f"features have shape {features.shape}, expected [batch, rows, {cfg.num_features}, "
                     f"{cfg.hidden_size}] (one per target_layer_ids {list(cfg.target_layer_ids)})")
  return model.hidden_norm(model.fc(features.reshape(b, q, k * h).astype(cfg.dtype)))


def context_kv(model: DFlashModel, features, positions):
  """Every layer's context keys/values of the given rows.

  Args:
    features: [B, Q, K, H]; positions: int32[B, Q] absolute positions of those tokens.
  Returns:
    (k, v), each [layers, B, Q, G, D]; k normed and roped.
  """
  ctx = fuse_context(model, features)
  _, (k, v) = _scan_layers(model, lambda layer, carry, _: (carry, layer.self_attn.keys_values(ctx, positions)),
                           None, None)
  return k, v


def extend(model: DFlashModel, cache: DFlashCache, slots, positions, features, num_new) -> DFlashCache:
  """Appends committed tokens to each slot's context.

  Args:
    slots: int32[B].
    positions: int32[B, Q], the tokens' absolute positions; ``positions[:, 0]`` should equal
      ``cache.lengths[slots]`` (rows are written at ``lengths[slot] + i`` and roped at
      ``positions[:, i]``; the two agree when every committed token is appended in order).
    features: [B, Q, K, H] target features of those tokens.
    num_new: int32[B], real rows; rows i >= num_new are padding: never written, whatever they hold.
  Returns:
    The cache with rows ``[len, len + num_new)`` written and lengths advanced by ``num_new``. Rows
    past ``max_len`` are dropped (the engine sizes the cache so that this cannot happen).
  """
  k, v = context_kv(model, features, positions)  # [L, B, Q, G, D]
  q_len = positions.shape[1]
  offsets = jnp.arange(q_len, dtype=jnp.int32)[None, :]
  # Padded rows go to column max_len, out of bounds, which `mode='drop'` discards.
  cols = jnp.where(offsets < num_new[:, None], cache.lengths[slots][:, None] + offsets, cache.max_len)
  rows = jnp.broadcast_to(slots[:, None], cols.shape)
  return DFlashCache(k=cache.k.at[:, rows, cols].set(k.astype(cache.k.dtype), mode='drop'),
                     v=cache.v.at[:, rows, cols].set(v.astype(cache.v.dtype), mode='drop'),
                     lengths=cache.lengths.at[slots].add(num_new.astype(jnp.int32)))


def _embed_blocks(cfg: DFlashConfig, embed_table, roots, starts):
  """Blocks ``[root, MASK x (B-1)]`` embedded with the target's table, and their positions.

  Args:
    roots, starts: int32[B, A].
  Returns:
    (x [B, A, S, H], positions int32[B, A, S]).
  """
  b, a = roots.shape
  s = cfg.block_size
  masks = jnp.full((b, a, s - 1), cfg.mask_token_id, jnp.int32)
  tokens = jnp.concatenate([roots[..., None].astype(jnp.int32), masks], axis=-1)
  positions = starts[..., None].astype(jnp.int32) + jnp.arange(s, dtype=jnp.int32)
  return jnp.take(embed_table, tokens, axis=0).astype(cfg.dtype), positions


def _run_blocks(model: DFlashModel, x, positions, ctx_k, ctx_v, ctx_visible, slots=None):
  """All layers and the final norm over blocks; the one code path of inference and training.

  Args:
    x: [B, A, S, H]; positions: int32[B, A, S]; ctx_visible: bool[B, A, T].
    ctx_k, ctx_v: [layers, B, T, G, D], or the cache pools [layers, num_slots + 1, T, G, D] with
      ``slots`` int32[B] picking each row's slot (gathered one layer at a time).
  Returns:
    [B, A, S, H] after the final norm.
  """

  def body(layer, x, kv):
    k, v = kv
    if slots is not None:
      k, v = k[slots], v[slots]
    return layer(x, positions, k, v, ctx_visible), None

  x, _ = _scan_layers(model, body, x, (ctx_k, ctx_v))
  return model.norm(x)


def _lm_head(hidden, embed_table, lm_head_kernel):
  """The target's LM head: [..., H] -> float32 [..., V]; ``lm_head_kernel`` None means tied."""
  flat = hidden.reshape(-1, hidden.shape[-1])
  if lm_head_kernel is None:
    logits = jnp.einsum('nh,vh->nv', flat.astype(embed_table.dtype), embed_table,
                        preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum('nh,hv->nv', flat.astype(lm_head_kernel.dtype), lm_head_kernel,
                        preferred_element_type=jnp.float32)
  return logits.reshape(hidden.shape[:-1] + (logits.shape[-1],))


def block_logits(model: DFlashModel, embed_table, lm_head_kernel, cache: DFlashCache, slots, root_tokens, start):
  """One drafting forward per request.

  Args:
    embed_table: [V, H] the target's embedding; lm_head_kernel: [H, V] its head (None: tied).
    slots: int32[B]; root_tokens: int32[B] tokens at positions ``start`` (not in the context).
    start: int32[B], the block's first position; equals ``cache.lengths[slots]`` in the engine.
  Returns:
    float32[B, L, V]: row d (0-based) scores the token at ``start + d + 1``. The block sees the
    slot's context columns ``< cache.lengths[slot]``.
  """
  x, positions = _embed_blocks(model.cfg, embed_table, root_tokens[:, None], start[:, None])
  visible = jnp.arange(cache.max_len, dtype=jnp.int32)[None, None, :] < cache.lengths[slots][:, None, None]
  hidden = _run_blocks(model, x, positions, cache.k, cache.v, visible, slots=slots)
  return _lm_head(hidden[:, 0, 1:], embed_table, lm_head_kernel)


def propose(model: DFlashModel, embed_table, lm_head_kernel, cache: DFlashCache, slots, root_tokens, start,
            top_k: int):
  """Top-k of each position's log-softmax: (ids int32[B, L, k], logprobs float32[B, L, k]),
  sorted descending (ids distinct per position)."""
  logits = block_logits(model, embed_table, lm_head_kernel, cache, slots, root_tokens, start)
  logprobs, ids = topk.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)
  return ids.astype(jnp.int32), logprobs


def train_block_logits(model: DFlashModel, embed_table, lm_head_kernel, tokens, features, anchors):
  """Many blocks of one sequence in one forward (the training path).

  Context K/V come from every position's features (positions 0..T-1); block a is
  ``[tokens[anchor_a], MASK...]`` at positions ``anchor_a ..`` and sees the context strictly
  before ``anchor_a`` and its own rows, never another block. Equals ``extend`` with the features
  of positions < anchor followed by ``block_logits(root=tokens[anchor], start=anchor)``.

  Args:
    tokens: int32[B, T]; features: [B, T, K, H]; anchors: int32[B, A] in [0, T).
  Returns:
    float32[B, A, L, V].
  """
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  ctx_k, ctx_v = context_kv(model, features, positions)
  anchors = anchors.astype(jnp.int32)
  roots = jnp.take_along_axis(tokens.astype(jnp.int32), anchors, axis=1)
  x, block_positions = _embed_blocks(model.cfg, embed_table, roots, anchors)
  visible = jnp.arange(t, dtype=jnp.int32)[None, None, :] < anchors[:, :, None]
  hidden = _run_blocks(model, x, block_positions, ctx_k, ctx_v, visible)
  return _lm_head(hidden[:, :, 1:], embed_table, lm_head_kernel)


def train_loss(model: DFlashModel, embed_table, lm_head_kernel, tokens, features, anchors, valid_len, *,
               gamma: float | None = None):
  """Position-weighted cross-entropy of blocks at ``anchors`` against the true continuation.

  Block position k (1..L) of anchor a is scored against ``tokens[a + k]`` with weight
  ``exp(-(k - 1) / gamma)`` (early positions matter most: a draft is accepted up to its first
  miss), and masked where ``a + k >= valid_len``.

  Args:
    tokens: int32[B, T]; features: [B, T, K, H] (target features of ``tokens``);
    anchors: int32[B, A]; valid_len: int32[B] real tokens per sequence (<= T).
    gamma: default ``model.cfg.gamma``.
  Returns:
    (loss scalar, metrics: ``accuracy`` float32[L] per position, ``accepted_length`` (mean leading
    run of correct argmax predictions over blocks with a target), ``num_targets`` int32[L]).
  """
  cfg = model.cfg
  gamma = cfg.gamma if gamma is None else gamma
  b, t = tokens.shape
  big_l = cfg.num_positions
  logits = train_block_logits(model, embed_table, lm_head_kernel, tokens, features, anchors)  # [B, A, L, V]
  depth = jnp.arange(1, big_l + 1, dtype=jnp.int32)
  target_pos = anchors[..., None].astype(jnp.int32) + depth  # [B, A, L]
  mask = (target_pos < jnp.minimum(valid_len, t)[:, None, None].astype(jnp.int32))
  targets = jnp.take_along_axis(tokens.astype(jnp.int32), jnp.clip(target_pos, 0, t - 1).reshape(b, -1),
                                axis=1).reshape(target_pos.shape)
  logprobs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
  weight = jnp.exp(-(depth - 1).astype(jnp.float32) / gamma) * mask
  loss = jnp.sum(weight * nll) / jnp.maximum(jnp.sum(weight), 1e-9)
  correct = (jnp.argmax(logits, axis=-1) == targets) & mask
  counts = jnp.sum(mask, axis=(0, 1))
  has_target = mask[..., 0]
  run = jnp.sum(jnp.cumprod(correct, axis=-1), axis=-1)  # leading correct predictions per block
  metrics = {
      "accuracy": jnp.sum(correct, axis=(0, 1)) / jnp.maximum(counts, 1),
      "accepted_length": jnp.sum(run * has_target) / jnp.maximum(jnp.sum(has_target), 1),
      "num_targets": counts.astype(jnp.int32),
  }
  return loss, metrics


def sample_anchors(key, valid_len, num_anchors: int, seq_len: int):
  """Distinct random anchors per sequence with at least one target after them.

  Args:
    valid_len: int32[B]. Returns int32[B, A] in ``[0, valid_len - 2]`` while there are enough
    positions; the rest fall at positions whose blocks ``train_loss`` masks entirely.
  """
  if not 0 < num_anchors <= seq_len:
    raise ValueError(f"num_anchors={num_anchors} must lie in [1, seq_len={seq_len}]")
  scores = jax.random.uniform(key, (valid_len.shape[0], seq_len))
  usable = jnp.arange(seq_len)[None, :] < (valid_len[:, None] - 1)
  _, anchors = jax.lax.top_k(jnp.where(usable, scores, -1.0), num_anchors)
  return anchors.astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Checkpoint naming (published DFlash: fc, hidden_norm, layers.{i}.*, norm; HF Linear is [out, in])
# ---------------------------------------------------------------------------------------------
_LAYER_ENTRIES = (
    ("input_layernorm.weight", ("input_layernorm", "weight"), False),
    ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), True),
    ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), True),
    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), True),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), True),
    ("self_attn.q_norm.weight", ("self_attn", "q_norm", "weight"), False),
    ("self_attn.k_norm.weight", ("self_attn", "k_norm", "weight"), False),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), False),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), True),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), True),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), True),
)
_TOP_ENTRIES = (
    ("fc.weight", ("fc", "kernel"), True),
    ("hidden_norm.weight", ("hidden_norm", "weight"), False),
    ("norm.weight", ("norm", "weight"), False),
)


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _attr_path(module, path):
  for name in path:
    module = getattr(module, name)
  return module


def to_hf_state_dict(model: DFlashModel) -> dict[str, np.ndarray]:
  """HF-named numpy tensors in HF layout (Linear weights [out, in])."""
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  out = {}
  for name, path, transpose in _TOP_ENTRIES:
    value = np.asarray(_get(state, path))
    out[name] = value.T if transpose else value
  for layer in range(model.cfg.num_hidden_layers):
    for name, path, transpose in _LAYER_ENTRIES:
      value = np.asarray(_get(state["layers"], path)[layer])
      out[f"layers.{layer}.{name}"] = value.T if transpose else value
  return out


def hf_names(cfg: DFlashConfig) -> list[str]:
  """The HF names of every tensor a drafter of ``cfg`` reads (``from_hf_state_dict``)."""
  return ([name for name, _, _ in _TOP_ENTRIES]
          + [f"layers.{i}.{name}" for i in range(cfg.num_hidden_layers) for name, _, _ in _LAYER_ENTRIES])


def from_hf_state_dict(cfg: DFlashConfig, tensors: Mapping[str, np.ndarray]) -> DFlashModel:
  """Builds a drafter from HF-named tensors (KeyError / ValueError name the bad tensor)."""
  model = abstract_dflash(cfg)
  dtype = jnp.dtype(cfg.param_dtype)

  def read(name, variable, transpose, layer=None):
    if name not in tensors:
      raise KeyError(f"checkpoint lacks tensor {name!r}")
    value = np.asarray(tensors[name])
    value = value.T if transpose else value
    shape = variable.shape[1:] if layer is not None else variable.shape
    if tuple(value.shape) != tuple(shape):
      raise ValueError(f"tensor {name!r} has shape {np.asarray(tensors[name]).shape}, expected "
                       f"{tuple(shape)[::-1] if transpose else tuple(shape)}")
    return value

  for name, path, transpose in _TOP_ENTRIES:
    variable = getattr(_attr_path(model, path[:-1]), path[-1])
    variable.set_value(jnp.asarray(read(name, variable, transpose), dtype))
  for name, path, transpose in _LAYER_ENTRIES:
    variable = getattr(_attr_path(model.layers, path[:-1]), path[-1])
    rows = [read(f"layers.{i}.{name}", variable, transpose, i) for i in range(cfg.num_hidden_layers)]
    variable.set_value(jnp.asarray(np.stack(rows), dtype))
  return model


# ---------------------------------------------------------------------------------------------
# Engine adapter (the ``ddtree_jax.drafters.Drafter`` protocol)
# ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashParams:
  """What the drafter's compiled calls read: its own model and the target's shared tables.

  Attributes:
    model: the DFlashModel.
    embed_table: [V, H], the target's embedding array itself (not a copy).
    lm_head_kernel: [H, V], the target's LM head kernel itself; None when the target ties it to
      the embedding (then the head is ``embed_table.T``, never materialised).
  """

  model: DFlashModel
  embed_table: jax.Array
  lm_head_kernel: jax.Array | None


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
  """DFlash behind the engine's ``Drafter`` protocol: static config only (hashable, no arrays).

  Usage::

    drafter = DFlashDrafter(dflash_model.cfg)
    engine.SpeculativeDecoder(target, drafter, DFlashDrafter.params(dflash_model, target), ...)
  """

  cfg: DFlashConfig

  @property
  def num_positions(self) -> int:
    return self.cfg.block_size - 1

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.cfg.target_layer_ids

  @staticmethod
  def params(dflash_model: DFlashModel, target_model) -> DFlashParams:
    """Pairs a drafter with the target whose embedding and LM head it shares (no copies)."""
    dflash_model.cfg.check_target(target_model.cfg)
    embed = target_model.embed_tokens.embedding[...]
    head = None if target_model.lm_head is None else target_model.lm_head.kernel[...]
    return DFlashParams(model=dflash_model, embed_table=embed, lm_head_kernel=head)

  def check_params(self, params) -> None:
    """A ValueError unless ``params`` are what ``params()`` returns (the engine checks at construction)."""
    if not isinstance(params, DFlashParams):
      raise ValueError(f"DFlashDrafter needs drafter_params = DFlashDrafter.params(dflash_model, target), got "
                       f"{type(params).__name__}")

  def init_state(self, num_slots: int, max_len: int) -> DFlashCache:
    return init_cache(self.cfg, num_slots, max_len)

  @staticmethod
  def reset_slot(state: DFlashCache, slot) -> DFlashCache:
    """Empties ``slot`` (int32[1]): its length to 0 (stale K/V rows lie past it). The engine
    compiles this ahead of time and runs it on the device, so an admission neither compiles nor
    waits for the steps in flight (a host round trip of ``lengths`` waited for all of them)."""
    return dataclasses.replace(state, lengths=state.lengths.at[slot].set(0))

  def reset(self, params, state: DFlashCache, slot, prompt) -> DFlashCache:
    """``reset_slot`` for callers of the plain protocol (op by op: one small compilation, once)."""
    del params, prompt
    return self.reset_slot(state, jnp.asarray(slot, jnp.int32))

  def extend(self, params: DFlashParams, state, slots, tokens, positions, features, num_new):
    del tokens  # the context is the target's features; the tokens entered through the target
    return extend(params.model, state, slots, positions, features, num_new)

  def propose(self, params: DFlashParams, state, slots, root_tokens, start, top_k: int):
    return propose(params.model, params.embed_table, params.lm_head_kernel, state, slots, root_tokens, start,
                   top_k)
