"""HF checkpoint naming for Kimi/DeepSeek-V3: our stacked NNX state <-> flat HF tensors.

HF Linear weights are ``[out, in]``; ours (``nnx.Linear.kernel``) are ``[in, out]``. Routed experts
are stacked ``[E, in, out]`` here and one tensor per expert there. Layers are stacked (dense,
then MoE) here and numbered ``model.layers.{i}`` there. INT4 experts (``cfg.experts_int4``) are
``weight_packed`` / ``weight_scale`` / ``weight_shape`` per expert there (compressed-tensors, as
K2.6 ships them) and ``int4.Int4Matrix`` stacks here; a model with dense experts loads an INT4
checkpoint by dequantising it, and a model with INT4 experts a bf16 checkpoint by quantising it
(symmetric group-32, ``int4.quantize_int4``).
"""

from typing import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import int4
from models.config import KimiConfig
from models.kimi import CHECKPOINT_VARIABLES, KimiModel

_ATTN_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_ATTN_NORMS = ("q_a_layernorm", "kv_a_layernorm")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _layer_entries(cfg: KimiConfig, layer: int):
  """(hf_name, path within the layer stack, transpose) for one decoder layer."""
  p = f"model.layers.{layer}."
  entries = [(p + "input_layernorm.weight", ("input_layernorm", "weight"), False),
             (p + "post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), False)]
  for name in _ATTN_LINEARS:
    entries.append((p + f"self_attn.{name}.weight", ("self_attn", name, "kernel"), True))
  for name in _ATTN_NORMS:
    entries.append((p + f"self_attn.{name}.weight", ("self_attn", name, "weight"), False))
  if layer < cfg.first_k_dense_replace:
    for name in _MLP:
      entries.append((p + f"mlp.{name}.weight", ("mlp", name, "kernel"), True))
  else:
    entries.append((p + "mlp.gate.weight", ("mlp", "gate"), True))
    entries.append((p + "mlp.gate.e_score_correction_bias", ("mlp", "e_score_correction_bias"), False))
    if cfg.n_shared_experts:
      for name in _MLP:
        entries.append((p + f"mlp.shared_experts.{name}.weight", ("mlp", "shared_experts", name, "kernel"), True))
  return entries


_EXPERT_STACKS = (("gate_proj", "experts_gate"), ("up_proj", "experts_up"), ("down_proj", "experts_down"))


def _stack_of(cfg: KimiConfig, layer: int):
  if layer < cfg.first_k_dense_replace:
    return "dense_layers", layer
  return "moe_layers", layer - cfg.first_k_dense_replace


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def hf_names(cfg: KimiConfig) -> list[str]:
  """Every tensor name of a checkpoint for ``cfg`` (experts expanded), in model order."""
  names = ["model.embed_tokens.weight"]
  for layer in range(cfg.num_hidden_layers):
    names += [entry[0] for entry in _layer_entries(cfg, layer)]
    if layer >= cfg.first_k_dense_replace:
      suffixes = ("weight_packed", "weight_scale", "weight_shape") if cfg.experts_int4 else ("weight",)
      names += [f"model.layers.{layer}.mlp.experts.{e}.{proj}.{suffix}"
                for e in range(cfg.n_routed_experts) for proj, _ in _EXPERT_STACKS for suffix in suffixes]
  names.append("model.norm.weight")
  if not cfg.tie_word_embeddings:
    names.append("lm_head.weight")
  return names


def iter_hf_tensors(model: KimiModel) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (hf_name, numpy array in HF layout), one tensor at a time (bounded host memory)."""
  cfg = model.cfg
  state = nnx.to_pure_dict(nnx.state(model, CHECKPOINT_VARIABLES))
  yield "model.embed_tokens.weight", np.asarray(state["embed_tokens"]["embedding"])
  for layer in range(cfg.num_hidden_layers):
    stack, index = _stack_of(cfg, layer)
    for name, path, transpose in _layer_entries(cfg, layer):
      value = np.asarray(_get(state[stack], path)[index])
      yield name, value.T if transpose else value
    if stack == "moe_layers":
      for proj, ours in _EXPERT_STACKS:
        prefix = f"model.layers.{layer}.mlp.experts"
        if cfg.experts_int4:
          in_features = cfg.hidden_size if proj != "down_proj" else cfg.moe_intermediate_size
          m = int4.from_kernel_layout(int4.KernelInt4Matrix(
              state[stack]["mlp"][ours + "_words"][index], state[stack]["mlp"][ours + "_scale"][index], in_features))
          packed, scale = int4.int4_to_compressed_tensors(m)
          for e in range(cfg.n_routed_experts):
            yield f"{prefix}.{e}.{proj}.weight_packed", packed[e]
            yield f"{prefix}.{e}.{proj}.weight_scale", scale[e]
            yield f"{prefix}.{e}.{proj}.weight_shape", np.array([m.out_features, m.in_features], np.int64)
        else:
          stacked = state[stack]["mlp"][ours][index]
          for e in range(cfg.n_routed_experts):
            yield f"{prefix}.{e}.{proj}.weight", np.asarray(stacked[e]).T
  yield "model.norm.weight", np.asarray(state["norm"]["weight"])
  if not cfg.tie_word_embeddings:
    yield "lm_head.weight", np.asarray(state["lm_head"]["kernel"]).T


def to_hf_state_dict(model: KimiModel) -> dict[str, np.ndarray]:
  return dict(iter_hf_tensors(model))


def load_hf_tensors(cfg: KimiConfig, get: Callable[[str], np.ndarray] | Mapping[str, np.ndarray],
                    *, prefix: str = "") -> KimiModel:
  """Builds a model from HF-named tensors.

  Args:
    get: a mapping or a function from HF name to array (for example a lazy safetensors reader).
    prefix: prepended to every name (``language_model.`` for K2.5/K2.6 multimodal checkpoints).
  Raises:
    KeyError naming the first missing tensor; ValueError naming a tensor of the wrong shape.
  """
  fetch = get.__getitem__ if isinstance(get, Mapping) else get
  abstract = nnx.eval_shape(lambda: KimiModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  target = nnx.to_pure_dict(abstract_state)
  param_dtype = jnp.dtype(cfg.param_dtype)

  def read(name, shape, transpose):
    try:
      value = np.asarray(fetch(prefix + name))
    except KeyError:
      raise KeyError(f"checkpoint lacks tensor {prefix + name!r}") from None
    if value.dtype.kind in "biu":  # integer bytes (raw FP8, a packed format) would load as numbers
      raise ValueError(f"tensor {prefix + name!r} is {value.dtype}, expected floating-point weights")
    value = value.T if transpose else value
    if tuple(value.shape) != tuple(shape):
      raise ValueError(f"tensor {prefix + name!r} has shape {value.shape[::-1] if transpose else value.shape}, "
                       f"expected {tuple(shape)[::-1] if transpose else tuple(shape)}")
    return value

  def put(path, value):
    parent = _get(target, path[:-1])
    dtype = jnp.float32 if path[-1] == "e_score_correction_bias" else param_dtype
    parent[path[-1]] = jnp.asarray(value, dtype=dtype)

  def read_int4_expert(layer: int, e: int, proj: str, out_features: int, in_features: int):
    """One expert's compressed-tensors tensors, checked: (weight_packed, weight_scale), numpy."""
    name = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
    tensors = {}
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
      try:
        tensors[suffix] = np.asarray(fetch(prefix + name + suffix))
      except KeyError:
        raise KeyError(f"checkpoint lacks tensor {prefix + name + suffix!r}") from None
    shape = tuple(int(v) for v in tensors["weight_shape"].reshape(-1))
    if shape != (out_features, in_features):
      raise ValueError(f"tensor {prefix + name}weight_shape is {list(shape)}, expected "
                       f"[{out_features}, {in_features}]")
    for suffix, want in (("weight_packed", (out_features, in_features // 8)),
                         ("weight_scale", (out_features, in_features // int4.GROUP_SIZE))):
      if tensors[suffix].shape != want:
        raise ValueError(f"tensor {prefix + name + suffix!r} has shape {tensors[suffix].shape}, expected {want}")
    # Checked here, one tensor at a time: stacking a layer's experts would promote a stray dtype.
    if tensors["weight_packed"].dtype not in (np.int32, np.uint32):
      raise ValueError(f"tensor {prefix + name}weight_packed is {tensors['weight_packed'].dtype}, expected int32 "
                       "(eight 4-bit values a word, as compressed-tensors packs them)")
    if tensors["weight_scale"].dtype.kind in "biu":
      raise ValueError(f"tensor {prefix + name}weight_scale is {tensors['weight_scale'].dtype}, expected "
                       "floating-point scales")
    return tensors["weight_packed"], tensors["weight_scale"]

  def has_tensor(name):
    if isinstance(get, Mapping):
      return prefix + name in get
    try:
      fetch(prefix + name)
      return True
    except KeyError:
      return False

  emb = target["embed_tokens"]["embedding"]
  put(("embed_tokens", "embedding"), read("model.embed_tokens.weight", emb.shape, False))
  put(("norm", "weight"), read("model.norm.weight", target["norm"]["weight"].shape, False))
  if not cfg.tie_word_embeddings:
    put(("lm_head", "kernel"), read("lm_head.weight", target["lm_head"]["kernel"].shape, True))
  for stack in ("dense_layers", "moe_layers"):
    if target.get(stack) is None:
      continue
    first = 0 if stack == "dense_layers" else cfg.first_k_dense_replace
    count = cfg.num_dense_layers if stack == "dense_layers" else cfg.num_moe_layers
    for name, path, transpose in _layer_entries(cfg, first):
      per_layer_shape = _get(target[stack], path).shape[1:]
      rows = [read(name.replace(f"layers.{first}.", f"layers.{first + i}.", 1), per_layer_shape, transpose)
              for i in range(count)]
      put((stack,) + path, np.stack(rows))
    if stack == "moe_layers":
      in_out = {"gate_proj": (cfg.hidden_size, cfg.moe_intermediate_size),
                "up_proj": (cfg.hidden_size, cfg.moe_intermediate_size),
                "down_proj": (cfg.moe_intermediate_size, cfg.hidden_size)}
      packed = has_tensor(f"model.layers.{first}.mlp.experts.0.gate_proj.weight_packed")
      for proj, ours in _EXPERT_STACKS:
        k_in, n_out = in_out[proj]
        if packed:
          layers = []  # one conversion per layer, of all its experts at once
          for i in range(count):
            packed_scale = [read_int4_expert(first + i, e, proj, n_out, k_in) for e in range(cfg.n_routed_experts)]
            layers.append(int4.kernel_layout_from_compressed_tensors(np.stack([p for p, _ in packed_scale]),
                                                                     np.stack([s for _, s in packed_scale])))
          if cfg.experts_int4:  # kept packed, in the kernel's layout
            _get(target, (stack, "mlp"))[ours + "_words"] = jnp.stack([m.words for m in layers])  # [L, E, out, Kp/8]
            _get(target, (stack, "mlp"))[ours + "_scale"] = jnp.stack([m.scale for m in layers])  # [L, E, out, Kp/32]
          else:  # a dense-expert model from an INT4 checkpoint: the format's bf16 weights
            put((stack, "mlp", ours), jnp.stack([int4.dequantize_int4(m) for m in layers]))
        else:
          def layer_weights(i):  # [E, K, N]
            return np.stack([read(f"model.layers.{first + i}.mlp.experts.{e}.{proj}.weight", (k_in, n_out), True)
                             for e in range(cfg.n_routed_experts)])
          if cfg.experts_int4:  # a bf16 checkpoint served with INT4 experts: quantised on load
            layers = [_quantize_layer(layer_weights(i), f"model.layers.{first + i}.mlp.experts.{{expert}}.{proj}.weight")
                      for i in range(count)]
            _get(target, (stack, "mlp"))[ours + "_words"] = jnp.stack([m.words for m in layers])
            _get(target, (stack, "mlp"))[ours + "_scale"] = jnp.stack([m.scale for m in layers])
          else:
            put((stack, "mlp", ours), np.stack([layer_weights(i) for i in range(count)]))
  state = abstract_state
  nnx.replace_by_pure_dict(state, target)
  return nnx.merge(graphdef, state)


# Experts quantised at a time on load: at K2.6's widths a slice's float32 copy, int32 nibbles and
# packed words are 1.9 + 1.9 + 0.9 GB on the device at once.
QUANTIZE_EXPERTS_PER_CALL = 32


def _quantize_layer(w: np.ndarray, name: str) -> int4.KernelInt4Matrix:
  """One layer's routed experts [E, K, N] (HF values, any float dtype) -> INT4 group-32 in the
  kernel's layout, by ``int4.quantize_int4`` (scale = max|w| / 7 per group, bf16), a slice of
  experts at a time to bound the device memory it takes. ``name`` (the tensors') for errors."""
  if not np.isfinite(w).all():  # inf or NaN would quantise into a NaN group
    expert = int(np.argwhere(~np.isfinite(w))[0][0])
    raise ValueError(f"{name.format(expert=expert)} has non-finite values: it cannot be quantised to INT4")
  parts = [int4.to_kernel_layout(int4.quantize_int4(jnp.asarray(w[e:e + QUANTIZE_EXPERTS_PER_CALL], jnp.float32)))
           for e in range(0, w.shape[0], QUANTIZE_EXPERTS_PER_CALL)]
  return int4.KernelInt4Matrix(words=jnp.concatenate([m.words for m in parts]),
                               scale=jnp.concatenate([m.scale for m in parts]), in_features=parts[0].in_features)


def from_hf_state_dict(cfg: KimiConfig, state_dict: Mapping[str, np.ndarray], *, prefix: str = "") -> KimiModel:
  return load_hf_tensors(cfg, state_dict, prefix=prefix)


def detect_prefix(names) -> str:
  """``language_model.`` when the text model is wrapped in a multimodal checkpoint, else ``''``."""
  names = set(names)
  if "model.embed_tokens.weight" in names:
    return ""
  if "language_model.model.embed_tokens.weight" in names:
    return "language_model."
  raise KeyError("checkpoint has neither model.embed_tokens.weight nor "
                 "language_model.model.embed_tokens.weight: not a Kimi/DeepSeek-V3 text model")


def tree_equal(a: KimiModel, b: KimiModel) -> bool:
  """Exact equality of two models' parameters (tests and round trips)."""
  sa = jax.tree.leaves(nnx.state(a, CHECKPOINT_VARIABLES))
  sb = jax.tree.leaves(nnx.state(b, CHECKPOINT_VARIABLES))
  return len(sa) == len(sb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(sa, sb))
