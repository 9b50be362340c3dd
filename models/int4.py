"""INT4 group-32 routed experts as K2.6 releases them (DESIGN §2), and their dense form.

K2-Thinking/K2.5/K2.6 ship the routed experts in compressed-tensors ``pack-quantized`` INT4:
symmetric, group 32 along the input features, ``weight_packed`` int32 [out, in / 8] with eight
nibbles per word (lowest first, value = nibble - 8), ``weight_scale`` bf16 [out, in / 32] and
``weight_shape`` [out, in]. ``Int4Matrix`` keeps the values as jnp.int4 (two to a byte on the
device) in the layout the Mosaic GPU kernel reads; this module converts both ways and checks a
checkpoint's ``quantization_config``.
"""

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GROUP_SIZE = 32  # INT4 quantisation group along the input features (K2.6's compressed-tensors)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Matrix:
  """One projection of E experts, ``y = x @ W`` with W [K, N] per expert, in INT4 group-32.

  ``W[e, k, n] = bf16(q[e, n, k] * scale[e, k // 32, n])`` (the product rounded once to bf16).

  Fields:
    q: int4 [E, N, K], values -8..7 (the checkpoint's nibble - 8), in the checkpoint's
      [out, in] order: each output feature's inputs are contiguous, so a kernel tile [64, K_t]
      is 64 rows of K_t / 2 bytes. XLA and Mosaic GPU both store int4 two to a byte.
    scale: bf16 [E, K // 32, N]: group-major, so a k-tile's scales for one group are one
      contiguous row over the tile's 64 output features.
  """

  q: jax.Array
  scale: jax.Array

  @property
  def num_experts(self) -> int:
    return self.q.shape[0]

  @property
  def in_features(self) -> int:
    return self.q.shape[2]

  @property
  def out_features(self) -> int:
    return self.q.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Experts:
  """Routed experts in INT4: gate, up: ``Int4Matrix`` [H -> I]; down: ``Int4Matrix`` [I -> H]."""

  gate: Int4Matrix
  up: Int4Matrix
  down: Int4Matrix


class Bf16Experts(NamedTuple):
  """Dense routed experts in the model's layout (bf16 for the kernel; the model's param dtype
  otherwise): gate, up [E, H, I]; down [E, I, H]."""

  gate: jax.Array
  up: jax.Array
  down: jax.Array


def quantize_int4(w) -> Int4Matrix:
  """Symmetric INT4 group-32 quantisation along the input features (the reference, plain jnp).

  Args:
    w: [E, K, N] float (K a multiple of 32).
  Returns:
    ``Int4Matrix`` with scale = max|w| / 7 per (expert, group, output) and q = round(w / scale)
    clipped to -8..7.
  """
  e, k, n = w.shape
  if k % GROUP_SIZE:
    raise ValueError(f"quantize_int4: input features K={k} must be a multiple of {GROUP_SIZE}")
  groups = w.astype(jnp.float32).reshape(e, k // GROUP_SIZE, GROUP_SIZE, n)
  scale = (jnp.max(jnp.abs(groups), axis=2) / 7.0).astype(jnp.bfloat16)  # [E, G, N]
  safe = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))
  q = jnp.clip(jnp.round(groups / safe[:, :, None, :]), -8, 7)
  q = q.reshape(e, k, n).transpose(0, 2, 1).astype(jnp.int4)
  return Int4Matrix(q=q, scale=scale)


def dequantize_int4(m: Int4Matrix, dtype=jnp.bfloat16):
  """[E, K, N] weights of an ``Int4Matrix``: q * scale in float32, rounded once to ``dtype``."""
  e, n, k = m.q.shape
  scale = jnp.repeat(m.scale.astype(jnp.float32), GROUP_SIZE, axis=1)  # [E, K, N]
  return (m.q.astype(jnp.float32).transpose(0, 2, 1) * scale).astype(dtype)


def int4_from_compressed_tensors(weight_packed, weight_scale) -> Int4Matrix:
  """Converts compressed-tensors ``pack-quantized`` INT4 (K2.6's routed experts) to ``Int4Matrix``.

  Args:
    weight_packed: int32 [E, out, in / 8] (or [out, in / 8] for one expert): eight 4-bit
      nibbles per word, the lowest nibble first; value = nibble - 8.
    weight_scale: bf16 [E, out, in / 32] (or [out, in / 32]).
  Returns:
    ``Int4Matrix`` with q [E, out, in], scale [E, in / 32, out].
  """
  packed = jnp.asarray(weight_packed)
  scale = jnp.asarray(weight_scale)
  if packed.ndim == 2:
    packed, scale = packed[None], scale[None]
  if packed.ndim != 3 or packed.dtype not in (jnp.int32, jnp.uint32):
    raise ValueError(f"weight_packed must be int32 [E, out, in/8], got {packed.dtype}{list(packed.shape)}")
  e, out, words = packed.shape
  if scale.shape != (e, out, words * 8 // GROUP_SIZE):
    raise ValueError(f"weight_scale {list(scale.shape)} does not match weight_packed {list(packed.shape)}: "
                     f"expected [{e}, {out}, {words * 8 // GROUP_SIZE}]")
  shifts = jnp.arange(8, dtype=jnp.uint32) * 4
  nibbles = (packed.astype(jnp.uint32)[..., None] >> shifts) & 0xF  # [E, out, in/8, 8], low first
  q = (nibbles.astype(jnp.int32) - 8).reshape(e, out, words * 8).astype(jnp.int4)
  return Int4Matrix(q=q, scale=jnp.swapaxes(scale, 1, 2).astype(jnp.bfloat16))


def quantize_experts(gate, up, down) -> Int4Experts:
  """``Int4Experts`` from bf16/f32 expert weights in the model's layout."""
  return Int4Experts(quantize_int4(gate), quantize_int4(up), quantize_int4(down))


def dequantize_experts(experts: Int4Experts, dtype=jnp.bfloat16) -> Bf16Experts:
  return Bf16Experts(*(dequantize_int4(m, dtype) for m in (experts.gate, experts.up, experts.down)))


def int4_to_compressed_tensors(m: Int4Matrix):
  """``Int4Matrix`` -> (weight_packed int32 [E, out, in / 8], weight_scale bf16 [E, out, in / 32]),
  numpy, the inverse of ``int4_from_compressed_tensors``."""
  q = np.asarray(m.q).astype(np.int32)  # [E, out, in]
  e, out, k = q.shape
  nibbles = (q + 8).astype(np.uint32).reshape(e, out, k // 8, 8)
  words = np.zeros((e, out, k // 8), np.uint32)
  for j in range(8):
    words |= nibbles[..., j] << np.uint32(4 * j)
  scale = np.swapaxes(np.asarray(m.scale), 1, 2)
  return words.view(np.int32), scale


# The quantization_config of K2-Thinking/K2.5/K2.6 (the parts that define the format): routed
# experts only; attention, shared experts, dense MLPs and lm_head stay bf16.
COMPRESSED_TENSORS_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": GROUP_SIZE, "dynamic": False},
        "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
               "re:.*mlp\\.gate$"],
    "kv_cache_scheme": None,
}


def check_quantization_config(qc: Mapping[str, Any]) -> None:
  """Raises ValueError naming what differs unless ``qc`` is K2.6's INT4 expert scheme."""
  if not isinstance(qc, Mapping):
    raise ValueError(f"quantization_config must be a dict, got {type(qc).__name__}")
  method = qc.get("quant_method")
  if method != "compressed-tensors":
    raise ValueError(f"quantization_config quant_method={method!r}: only K2.6's 'compressed-tensors' INT4 "
                     "experts are supported (K2's FP8 block scales are not)")
  if qc.get("format") != "pack-quantized":
    raise ValueError(f"quantization_config format={qc.get('format')!r}: expected 'pack-quantized'")
  groups = qc.get("config_groups")
  if not isinstance(groups, Mapping) or len(groups) != 1:
    raise ValueError(f"quantization_config must have exactly one config group, got {groups!r}")
  (group,) = groups.values()
  weights = group.get("weights") or {}
  want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP_SIZE}
  for key, value in want.items():
    if weights.get(key) != value:
      raise ValueError(f"quantization_config weights.{key}={weights.get(key)!r}: only INT4 symmetric "
                       f"group-{GROUP_SIZE} weights ({want}) are supported")
  for key in ("input_activations", "output_activations"):
    if group.get(key):
      raise ValueError(f"quantization_config {key} are quantised: only weight-only INT4 is supported")
