"""Kimi K2.6 (DeepSeek-V3 architecture) text-decoder configuration."""

import copy
import dataclasses
import math
from typing import Any, Mapping

from models import int4

KERNEL_IMPLS = ("xla", "pallas")  # KimiConfig.attention_impl, moe_impl
# How the routed experts are held, whatever the checkpoint stores: ``auto`` as stored, ``int4``
# quantised on load from a dense checkpoint (symmetric group-32), ``dense`` dequantised on load
# from an INT4 one (in param_dtype).
EXPERT_FORMATS = ("auto", "int4", "dense")


def expert_format_overrides(experts: str) -> dict:
  """``load_kimi`` overrides for an ``EXPERT_FORMATS`` choice (command lines' ``--experts``)."""
  if experts not in EXPERT_FORMATS:
    raise ValueError(f"experts {experts!r}: expected one of {EXPERT_FORMATS}")
  return {} if experts == "auto" else {"experts_int4": experts == "int4"}


def kernel_backend_error(backend: str, **impls: str) -> str | None:
  """Why the kernels ``impls`` (``attention_impl="pallas"``, ...) cannot run on ``backend``, or None.
  For command lines, which should refuse at startup rather than at the first compile."""
  for name, impl in impls.items():
    if impl == "pallas" and backend != "gpu":
      return (f"{name}='pallas' runs a Mosaic GPU kernel and needs a GPU backend, not {backend!r}; "
              f"use {name}='xla' here")
  return None


def kernel_dtype_error(dtype: str, **impls: str) -> str | None:
  """Why the kernels ``impls`` cannot serve a model computing in ``dtype``, or None. Both Pallas
  kernels multiply bf16 operands (the attention casts its queries and pool, the experts take
  bf16 activations), so a float32 model would silently lose the exactness float32 promises."""
  for name, impl in impls.items():
    if impl == "pallas" and dtype != "bfloat16":
      return (f"{name}='pallas' computes in bfloat16, so a {dtype} model would not get {dtype} results; "
              f"use dtype bfloat16 or {name}='xla'")
  return None


class ConfigError(ValueError):
  """A configuration value is missing, inconsistent or unsupported."""


def yarn_mscale(factor: float, mscale: float) -> float:
  """YaRN magnitude correction m(f, a) = 0.1 * a * ln(f) + 1 (1 for f <= 1)."""
  if factor <= 1.0:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class KimiConfig:
  """Every dimension and constant of the Kimi K2.6 text decoder (DESIGN §2).

  Names follow HF's ``config.json`` where one exists.
  """

  vocab_size: int = 163840
  hidden_size: int = 7168
  num_hidden_layers: int = 61
  first_k_dense_replace: int = 1  # layers [0, k) use the dense MLP, the rest MoE
  intermediate_size: int = 18432  # dense MLP width
  moe_intermediate_size: int = 2048  # routed (and shared) expert width
  n_routed_experts: int = 384
  num_experts_per_tok: int = 8
  n_shared_experts: int = 1
  routed_scaling_factor: float = 2.827
  norm_topk_prob: bool = True
  n_group: int = 1
  topk_group: int = 1
  num_attention_heads: int = 64
  q_lora_rank: int = 1536
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  rope_theta: float = 50000.0
  # YaRN (rope_scaling). factor 1 disables it.
  rope_factor: float = 64.0
  rope_original_max_position_embeddings: int = 4096
  rope_beta_fast: float = 1.0
  rope_beta_slow: float = 1.0
  rope_mscale: float = 1.0
  rope_mscale_all_dim: float = 1.0
  max_position_embeddings: int = 262144
  rms_norm_eps: float = 1e-5
  # eps of the two latent norms (q_a_layernorm, kv_a_layernorm). DeepSeek-V3's published modeling
  # code (the HF remote code that Kimi checkpoints ship, and deepseek-ai's inference/model.py)
  # builds them with RMSNorm's default 1e-6, not rms_norm_eps; K2.6's rms_norm_eps is 1e-5, so
  # there the two differ. Not an HF config key: from_hf reads it only from this project's own
  # config.json files (to_hf writes it), else 1e-6.
  latent_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  # Initialisation of fresh (untrained) models: normal(initializer_range) weights and a
  # normal(router_bias_init_std) e_score_correction_bias (0 for checkpoints, which carry it).
  initializer_range: float = 0.02
  router_bias_init_std: float = 0.0
  # Numerics: parameters are stored in param_dtype, matmuls run in dtype; norms, router and
  # softmax always run in float32.
  dtype: str = "bfloat16"
  param_dtype: str = "bfloat16"
  # Implementations of the two hot pieces (the Pallas kernels replace them on the GPU). Both
  # kernels multiply bf16 operands: "pallas" experts need dtype bfloat16; "pallas" attention under
  # a float32 model computes the attention in bf16 (allowed for kernel tests; the command lines
  # refuse it, ``kernel_dtype_error``).
  attention_impl: str = "xla"
  moe_impl: str = "xla"
  # Routed experts stored INT4 group-32 (K2.6 as released, ``models/int4.py``) instead of
  # param_dtype: the Pallas kernel reads them packed; the XLA path dequantises them per call.
  experts_int4: bool = False
  # Token ids the serving stack needs (Kimi's: [BOS]=163584, [EOS]=163585, <|im_end|>=163586).
  bos_token_id: int = 163584
  eos_token_id: int = 163585

  def __post_init__(self):
    self.validate()

  # ---- derived quantities -------------------------------------------------------------
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def latent_dim(self) -> int:
    """Width of one cached token per layer: c_kv (kv_lora_rank) + k_pe (qk_rope_head_dim)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def num_moe_layers(self) -> int:
    return self.num_hidden_layers - self.first_k_dense_replace

  @property
  def num_dense_layers(self) -> int:
    return self.first_k_dense_replace

  @property
  def softmax_scale(self) -> float:
    """qk_head_dim**-0.5 times m(factor, mscale_all_dim)**2 (YaRN)."""
    m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
    return self.qk_head_dim**-0.5 * m * m

  @property
  def rope_cos_sin_scale(self) -> float:
    """cos/sin multiplier m(factor, mscale) / m(factor, mscale_all_dim)."""
    return yarn_mscale(self.rope_factor, self.rope_mscale) / yarn_mscale(
        self.rope_factor, self.rope_mscale_all_dim)

  # ---- validation ------------------------------------------------------------------------
  def validate(self) -> None:
    positive = [
        "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
        "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
        "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
        "rope_original_max_position_embeddings",
    ]
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"KimiConfig.{name} must be a positive int, got {value!r}")
    for name in ("first_k_dense_replace", "n_shared_experts", "n_group", "topk_group", "bos_token_id",
                 "eos_token_id"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"KimiConfig.{name} must be an int, got {value!r}")
    for name in ("norm_topk_prob", "tie_word_embeddings", "experts_int4"):
      if not isinstance(getattr(self, name), bool):
        raise ConfigError(f"KimiConfig.{name} must be true or false, got {getattr(self, name)!r}")
    if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
      raise ConfigError(
          f"KimiConfig.first_k_dense_replace={self.first_k_dense_replace} must lie in "
          f"[0, num_hidden_layers={self.num_hidden_layers}]")
    if self.num_experts_per_tok > self.n_routed_experts:
      raise ConfigError(
          f"KimiConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
          f"n_routed_experts={self.n_routed_experts}")
    if self.n_shared_experts < 0:
      raise ConfigError(f"KimiConfig.n_shared_experts must be >= 0, got {self.n_shared_experts}")
    if self.n_group != 1 or self.topk_group != 1:
      raise ConfigError(
          f"KimiConfig.n_group={self.n_group}, topk_group={self.topk_group}: group-limited routing "
          "is not supported (Kimi K2 routes over one group: n_group = topk_group = 1)")
    if self.qk_rope_head_dim % 2:
      raise ConfigError(
          f"KimiConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    for name in ("rope_theta", "rope_factor", "rms_norm_eps", "latent_norm_eps", "routed_scaling_factor"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"KimiConfig.{name} must be > 0, got {value!r}")
    if self.rope_factor < 1.0:
      raise ConfigError(f"KimiConfig.rope_factor={self.rope_factor} must be >= 1 (1 disables YaRN)")
    for name in ("initializer_range", "router_bias_init_std"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"KimiConfig.{name} must be >= 0, got {value!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ConfigError(
            f"KimiConfig.{name}={getattr(self, name)!r}: expected float32, bfloat16 or float16")
    for name in ("attention_impl", "moe_impl"):
      if getattr(self, name) not in KERNEL_IMPLS:
        raise ConfigError(f"KimiConfig.{name}={getattr(self, name)!r}: expected 'xla' or 'pallas'")
    error = kernel_dtype_error(self.dtype, moe_impl=self.moe_impl)
    if error:  # the kernel would refuse it at the first trace
      raise ConfigError(f"KimiConfig.{error}")
    if self.experts_int4 and (self.hidden_size % 32 or self.moe_intermediate_size % 32):
      raise ConfigError(
          f"KimiConfig.experts_int4: INT4 groups of 32 need hidden_size ({self.hidden_size}) and "
          f"moe_intermediate_size ({self.moe_intermediate_size}) to be multiples of 32")
    for name in ("bos_token_id", "eos_token_id"):
      value = getattr(self, name)
      if not 0 <= value < self.vocab_size:
        raise ConfigError(f"KimiConfig.{name}={value} outside the vocabulary [0, {self.vocab_size})")

  def replace(self, **changes) -> "KimiConfig":
    return dataclasses.replace(self, **changes)

  # ---- presets ---------------------------------------------------------------------------
  @classmethod
  def k2_6(cls, **overrides) -> "KimiConfig":
    """The real Kimi K2.6 text decoder (about 1.03T parameters)."""
    return cls(**overrides)

  @classmethod
  def tiny(cls, **overrides) -> "KimiConfig":
    """A few-layer model that runs in seconds on a CPU, exercising every code path.

    YaRN is on (factor 4 over 32 original positions, so that positions past 32 interpolate,
    with mscale != mscale_all_dim so that both YaRN scales differ from 1).
    """
    fields = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.827,
        num_attention_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_theta=50000.0,
        rope_factor=4.0,
        rope_original_max_position_embeddings=32,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=0.707,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        router_bias_init_std=0.3,
        dtype="float32",
        param_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return cls(**fields)

  @classmethod
  def demo(cls, **overrides) -> "KimiConfig":
    """The shipped demo target (``kimi-demo``): Kimi's architecture at about 16M parameters.

    MLA with a latent cache, a dense first layer, then MoE layers of 8 routed experts (top 2)
    plus a shared expert, YaRN over 512 original positions; vocabulary of the demo tokenizer
    (``<|endoftext|>`` = 0 ends generation).
    """
    fields = dict(
        vocab_size=8192, hidden_size=384, num_hidden_layers=6, first_k_dense_replace=1,
        intermediate_size=1024, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=2.5, num_attention_heads=6, q_lora_rank=192,
        kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, rope_theta=50000.0,
        rope_factor=4.0, rope_original_max_position_embeddings=512, rope_beta_fast=32.0,
        rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0, max_position_embeddings=4096,
        rms_norm_eps=1e-5, latent_norm_eps=1e-5, initializer_range=0.02, bos_token_id=0, eos_token_id=0,
        dtype="bfloat16", param_dtype="float32")
    fields.update(overrides)
    return cls(**fields)

  # ---- HF config.json ---------------------------------------------------------------------
  @classmethod
  def from_hf(cls, config: Mapping[str, Any], **overrides) -> "KimiConfig":
    """Reads an HF ``config.json`` dict: plain DeepseekV3/Kimi, or K2.5/K2.6's ``text_config``."""
    if not isinstance(config, Mapping):
      raise ConfigError(f"from_hf expects a config.json dict, got {type(config).__name__}")
    outer = config  # K2.5/K2.6 keep quantization_config beside text_config
    config = text_model_config(config)
    required = [
        "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
        "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
        "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim",
    ]
    missing = [k for k in required if config.get(k) is None]
    if missing:
      raise ConfigError(f"config.json lacks {', '.join(missing)} (not a DeepSeek-V3/Kimi config?)")
    fields = {k: config[k] for k in required}
    optional = {
        "first_k_dense_replace": "first_k_dense_replace",
        "n_shared_experts": "n_shared_experts",
        "routed_scaling_factor": "routed_scaling_factor",
        "norm_topk_prob": "norm_topk_prob",
        "n_group": "n_group",
        "topk_group": "topk_group",
        "rope_theta": "rope_theta",
        "max_position_embeddings": "max_position_embeddings",
        "rms_norm_eps": "rms_norm_eps",
        "latent_norm_eps": "latent_norm_eps",
        "tie_word_embeddings": "tie_word_embeddings",
        "initializer_range": "initializer_range",
        "bos_token_id": "bos_token_id",
        "eos_token_id": "eos_token_id",
    }
    for hf_name, name in optional.items():
      if config.get(hf_name) is not None:
        fields[name] = config[hf_name]
    if "n_shared_experts" in config and config["n_shared_experts"] is None:  # DeepSeek-V3's code: none
      fields["n_shared_experts"] = 0
    moe_layer_freq = config.get("moe_layer_freq", 1)
    if moe_layer_freq != 1:  # DeepSeek-V3 makes only every moe_layer_freq-th layer MoE; Kimi has 1
      raise ConfigError(f"config.json moe_layer_freq={moe_layer_freq!r}: only 1 (every layer from "
                        "first_k_dense_replace on is MoE, as in DeepSeek-V3 and Kimi) is supported")
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
      raise ConfigError(f"config.json hidden_act={hidden_act!r}: only 'silu' (DeepSeek-V3/Kimi) is supported")
    if isinstance(fields.get("eos_token_id"), list):  # the first of several stop ids
      if not fields["eos_token_id"]:
        raise ConfigError("config.json eos_token_id is an empty list")
      fields["eos_token_id"] = fields["eos_token_id"][0]
    quantization = config.get("quantization_config") or outer.get("quantization_config")
    if quantization:
      try:
        int4.check_quantization_config(quantization)
      except ValueError as err:
        raise ConfigError(f"config.json: {err}") from None
      fields["experts_int4"] = True
    scoring = config.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
      raise ConfigError(f"config.json scoring_func={scoring!r}: only 'sigmoid' (DeepSeek-V3/Kimi) is supported")
    topk_method = config.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
      raise ConfigError(f"config.json topk_method={topk_method!r}: only 'noaux_tc' is supported")
    rope_scaling = rope_scaling_fields(config)
    if rope_theta_field(config) is not None:
      fields["rope_theta"] = rope_theta_field(config)
    if rope_scaling:
      source = rope_scaling.pop("_source")

      def number(key, kind, default=None):
        value = rope_scaling.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
          raise ConfigError(f"config.json {source}.{key} must be a{'n int' if kind is int else ' number'}, "
                            f"got {value!r}")
        return kind(value)
      fields.update(
          rope_factor=number("factor", float),
          rope_original_max_position_embeddings=number("original_max_position_embeddings", int),
          rope_beta_fast=number("beta_fast", float, 32),
          rope_beta_slow=number("beta_slow", float, 1),
          rope_mscale=number("mscale", float, 1),
          rope_mscale_all_dim=number("mscale_all_dim", float, 0),
      )
    else:
      fields.update(rope_factor=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                    rope_original_max_position_embeddings=int(
                        config.get("max_position_embeddings", 4096)))
    fields.update(overrides)
    return cls(**fields)

  def to_hf(self) -> dict:
    """The HF ``config.json`` dict for this configuration (DeepseekV3 naming)."""
    out = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "moe_layer_freq": 1,
        "torch_dtype": self.param_dtype,
        "rope_scaling": {
            "type": "yarn",
            "factor": self.rope_factor,
            "original_max_position_embeddings": self.rope_original_max_position_embeddings,
            "beta_fast": self.rope_beta_fast,
            "beta_slow": self.rope_beta_slow,
            "mscale": self.rope_mscale,
            "mscale_all_dim": self.rope_mscale_all_dim,
        },
    }
    skip = {"dtype", "param_dtype", "attention_impl", "moe_impl", "router_bias_init_std", "experts_int4"}
    for f in dataclasses.fields(self):
      if f.name.startswith("rope_") and f.name != "rope_theta":
        continue
      if f.name not in skip:
        out[f.name] = getattr(self, f.name)
    if self.experts_int4:
      out["quantization_config"] = copy.deepcopy(int4.COMPRESSED_TENSORS_CONFIG)
    return out


_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1}  # transformers' (the mscales' defaults differ by reader)


def rope_theta_field(config: Mapping[str, Any]):
  """An HF config's rope_theta: at the top level or, as transformers v5 writes it, inside
  ``rope_parameters`` (None where neither has it); the two disagreeing is refused."""
  params = config.get("rope_parameters")
  outer, inner = config.get("rope_theta"), params.get("rope_theta") if isinstance(params, Mapping) else None
  if outer is not None and inner is not None and outer != inner:
    raise ConfigError(f"config.json rope_theta={outer!r} and rope_parameters.rope_theta={inner!r} disagree")
  return outer if outer is not None else inner


def rope_scaling_fields(config: Mapping[str, Any]) -> dict | None:
  """The YaRN fields of an HF config (with ``_source``, the key they came from), or None for
  plain RoPE. transformers before v5 writes them as ``rope_scaling`` ({"type" or "rope_type":
  "yarn", ...}); v5 as ``rope_parameters`` (the same fields, ``rope_type`` "yarn" or "default",
  and ``rope_theta``). Both present must agree: silently preferring one could turn YaRN off."""
  found = {}
  for source in ("rope_scaling", "rope_parameters"):
    value = config.get(source)
    if value is None:
      continue
    if not isinstance(value, Mapping):
      raise ConfigError(f"config.json {source} must be a dict, got {value!r}")
    kind = value.get("type", value.get("rope_type"))
    if kind is None and source == "rope_parameters" and value.get("factor") is None:
      kind = "default"  # transformers v5 may leave the type out of plain RoPE's parameters
    if kind == "default" or (not value and source == "rope_scaling"):
      found[source] = None
      continue
    if kind != "yarn":
      raise ConfigError(f"config.json {source} type {kind!r}: only 'yarn' (or 'default', no scaling) is supported")
    missing = [k for k in ("factor", "original_max_position_embeddings") if value.get(k) is None]
    if missing:
      raise ConfigError(f"config.json {source} lacks {', '.join(missing)}")
    found[source] = dict(value, _source=source)
  if len(found) == 2:
    a, b = found["rope_scaling"], found["rope_parameters"]
    pick = lambda d: None if d is None else {k: d.get(k, _YARN_DEFAULTS.get(k)) for k in _YARN_KEYS}
    if pick(a) != pick(b):
      raise ConfigError(f"config.json rope_scaling {pick(a)} and rope_parameters {pick(b)} disagree")
  return found.get("rope_scaling", found.get("rope_parameters"))


def text_model_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
  """The text model's fields of an HF ``config.json`` dict: the dict itself, or K2.5/K2.6's
  ``text_config`` inside it."""
  if "text_config" not in config:
    return config
  text = config["text_config"]
  if not isinstance(text, Mapping):
    raise ConfigError("config.json's text_config is not a dict")
  return text


def eos_token_ids(config: Mapping[str, Any]) -> list[int]:
  """Every end-of-sequence id an HF ``config.json`` dict lists (``KimiConfig.eos_token_id`` keeps
  the first of a list); none where it lists none."""
  listed = text_model_config(config).get("eos_token_id")
  listed = listed if isinstance(listed, list) else [listed]
  return [i for i in listed if isinstance(i, int) and not isinstance(i, bool)]
