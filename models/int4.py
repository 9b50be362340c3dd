"""INT4 group-32 routed experts as K2.6 releases them (DESIGN §2), and their dense form.

K2-Thinking/K2.5/K2.6 ship the routed experts in compressed-tensors ``pack-quantized`` INT4:
symmetric, group 32 along the input features, ``weight_packed`` int32 [out, in / 8] with eight
nibbles per word (lowest first, value = nibble - 8), ``weight_scale`` bf16 [out, in / 32] and
``weight_shape`` [out, in]. ``Int4Matrix`` holds that format unpacked (jnp.int4 values, the
plain reference); ``KernelInt4Matrix`` holds it as the model and the Mosaic GPU kernel keep it:
the same nibbles, permuted once inside blocks of 256 input features so that the kernel turns
each 32-bit word into wgmma operand registers with a few instructions. This module converts
between the three (``kernel_layout_from_compressed_tensors`` goes straight from the checkpoint's
words) and checks a checkpoint's ``quantization_config``.
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
      [out, in] order.
    scale: bf16 [E, K // 32, N].
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
    ``Int4Matrix`` with scale = max|w| / 7 per (expert, group, output) (bf16) and q = w / scale
    rounded half to even (exactly) and clipped to -8..7; a group whose scale or weights would be
    float32 subnormals (max|w| below 7 * 2**-126) comes out zero, as XLA flushes subnormals.
  """
  if w.shape[1] % GROUP_SIZE:
    raise ValueError(f"quantize_int4: input features K={w.shape[1]} must be a multiple of {GROUP_SIZE}")
  q, scale = _quantize(w)
  return Int4Matrix(q=q, scale=scale)


@jax.jit  # one fused loop: run op by op, the 15 comparisons below cost 4-5x the whole jitted call
def _quantize(w):
  """``quantize_int4``'s (q int4 [E, N, K], scale bf16 [E, K / 32, N])."""
  e, k, n = w.shape
  groups = w.astype(jnp.float32).reshape(e, k // GROUP_SIZE, GROUP_SIZE, n)
  scale_f32 = _round_to_bf16(jnp.max(jnp.abs(groups), axis=2) / 7.0)  # [E, G, N]
  # round-half-even(w / scale) clipped to -8..7, without dividing: XLA's vectorised f32 divide is
  # not correctly rounded on every backend (on the CPU a quotient of bf16 values that is exactly
  # n + 0.5 comes out one ulp high and rounds away from even). The boundaries (n + 0.5) * scale
  # are exact in f32 (scale has 8 significant bits), so comparing against them is exact; q counts
  # the boundaries below w, a boundary w sits on counting when n + 1 is even.
  s = scale_f32[:, :, None, :]
  q = jnp.full(groups.shape, -8, jnp.int32)
  for n_below in range(-8, 7):
    boundary = (n_below + 0.5) * s
    q += (groups > boundary) | ((groups == boundary) & ((n_below + 1) % 2 == 0))
  q = jnp.where(s == 0, 0, q)  # an all-zero group: every boundary is 0
  q = q.reshape(e, k, n).transpose(0, 2, 1).astype(jnp.int4)
  return q, scale_f32.astype(jnp.bfloat16)  # exact: already a bf16 value


def _round_to_bf16(x):
  """float32 -> float32 holding the nearest bf16 value (half to even; finite inputs), by integer
  operations: under jit XLA's GPU compiler drops a float32 -> bf16 -> float32 round trip inside a
  fusion (excess precision), which compared w against the unrounded scale (seen on the H200)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequantize_int4(m, dtype=jnp.bfloat16):
  """[E, K, N] weights of an ``Int4Matrix`` (or ``KernelInt4Matrix``): q * scale in float32, rounded
  once to ``dtype``."""
  if isinstance(m, KernelInt4Matrix):
    m = from_kernel_layout(m)
  e, n, k = m.q.shape
  scale = jnp.repeat(m.scale.astype(jnp.float32), GROUP_SIZE, axis=1)  # [E, K, N]
  return (m.q.astype(jnp.float32).transpose(0, 2, 1) * scale).astype(dtype)


def _checked_compressed(weight_packed, weight_scale):
  """numpy (packed [E, out, in / 8], scale [E, out, in / 32]), a single expert's given a leading
  axis; raises ValueError naming what does not match."""
  packed, scale = np.asarray(weight_packed), np.asarray(weight_scale)
  if packed.ndim == 2:
    packed, scale = packed[None], scale[None]
  if packed.ndim != 3 or packed.dtype not in (np.int32, np.uint32):
    raise ValueError(f"weight_packed must be int32 [E, out, in/8], got {packed.dtype}{list(packed.shape)}")
  e, out, words = packed.shape
  if scale.shape != (e, out, words * 8 // GROUP_SIZE):
    raise ValueError(f"weight_scale {list(scale.shape)} does not match weight_packed {list(packed.shape)}: "
                     f"expected [{e}, {out}, {words * 8 // GROUP_SIZE}]")
  return packed, scale


def int4_from_compressed_tensors(weight_packed, weight_scale) -> Int4Matrix:
  """Converts compressed-tensors ``pack-quantized`` INT4 (K2.6's routed experts) to ``Int4Matrix``.

  Args:
    weight_packed: int32 [E, out, in / 8] (or [out, in / 8] for one expert): eight 4-bit
      nibbles per word, the lowest nibble first; value = nibble - 8.
    weight_scale: bf16 [E, out, in / 32] (or [out, in / 32]).
  Returns:
    ``Int4Matrix`` with q [E, out, in], scale [E, in / 32, out].
  """
  packed, scale = _checked_compressed(weight_packed, weight_scale)
  packed, scale = jnp.asarray(packed), jnp.asarray(scale)
  e, out, words = packed.shape
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
  if weights.get("actorder") not in (None, False):
    # Activation ordering permutes each row's groups (a weight_g_idx tensor): not K2.6's layout.
    raise ValueError(f"quantization_config weights.actorder={weights.get('actorder')!r}: only INT4 without "
                     "activation ordering is supported")


# ---------------------------------------------------------------------------------------------
# The Mosaic GPU kernel's layout (``KernelInt4Matrix``)
# ---------------------------------------------------------------------------------------------
PACK_BLOCK = 256  # input features per permuted block: one 128-byte row of packed words


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelInt4Matrix:
  """``Int4Matrix`` in the layout the Mosaic GPU kernel dequantises with few instructions.

  ``words`` uint32 [E, N, Kp / 8] (Kp = K rounded up to ``PACK_BLOCK``) holds the nibbles
  ``q + 8`` (the checkpoint's offset binary), permuted inside each block of 256 input features so
  that one thread's 32-bit word yields four bf16 pairs that are already registers of a wgmma
  A operand: word ``32 b + 8 t + i`` of a row holds, at bit ``16 h + 4 j``, input feature
  ``256 b + 32 i + 8 j + 2 t + h`` (t: the thread's column pair, i: its word, j: the nibble in
  each half, h: the half). ``scale`` bf16 [E, N, Kp / 32] (the checkpoint's [out, in / 32]
  order, zero past K). ``in_features`` is K.
  """

  words: jax.Array
  scale: jax.Array
  in_features: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_experts(self) -> int:
    return self.words.shape[0]

  @property
  def out_features(self) -> int:
    return self.words.shape[1]


def _block_axes(kp: int):
  """Kp input features as (block b, word i, nibble j, thread t, half h)."""
  return (kp // PACK_BLOCK, 8, 4, 4, 2)


def _nibble_shifts():
  """uint32 [h, j]: where nibble j of half h sits in a word, 16 h + 4 j."""
  return jnp.arange(2, dtype=jnp.uint32)[:, None] * 16 + jnp.arange(4, dtype=jnp.uint32)[None, :] * 4


def to_kernel_layout(m: Int4Matrix) -> KernelInt4Matrix:
  """``Int4Matrix`` -> ``KernelInt4Matrix`` (plain jnp: quantised initialisations, tests; loading
  permutes the checkpoint's words directly, ``kernel_layout_from_compressed_tensors``)."""
  e, n, k = m.q.shape
  kp = -(-k // PACK_BLOCK) * PACK_BLOCK
  nib = (m.q.astype(jnp.int32) + 8).astype(jnp.uint32)
  nib = jnp.pad(nib, ((0, 0), (0, 0), (0, kp - k)), constant_values=8)  # q = 0 past K
  nib = nib.reshape(e, n, *_block_axes(kp))  # [E, N, b, i, j, t, h]
  nib = nib.transpose(0, 1, 2, 5, 3, 6, 4)  # [E, N, b, t, i, h, j]
  words = jnp.sum(nib << _nibble_shifts(), axis=(-2, -1), dtype=jnp.uint32)  # disjoint bits: sum == or
  scale = jnp.swapaxes(m.scale, 1, 2)  # [E, N, K / 32]
  scale = jnp.pad(scale, ((0, 0), (0, 0), (0, (kp - k) // GROUP_SIZE)))
  return KernelInt4Matrix(words=words.reshape(e, n, kp // 8), scale=scale.astype(jnp.bfloat16), in_features=k)


def kernel_layout_from_compressed_tensors(weight_packed, weight_scale) -> KernelInt4Matrix:
  """K2.6's ``weight_packed`` int32 [E, out, in / 8] / ``weight_scale`` bf16 [E, out, in / 32] ->
  ``KernelInt4Matrix``, in numpy, a pure permutation of nibbles (no [E, out, in] intermediate,
  so a real layer converts in about its own size). Both encode q + 8."""
  packed, scale = _checked_compressed(weight_packed, weight_scale)
  e, out, words = packed.shape
  k = words * 8
  kp = -(-k // PACK_BLOCK) * PACK_BLOCK
  src = np.full((e, out, kp // 8), 0x88888888, np.uint32)  # q = 0 past K
  src[..., :words] = packed.view(np.uint32)
  # Source word 32 b + 4 i + j holds features 8 (4 i + j) + 0..7 of block b; feature 2 t + h of
  # it goes to bit 16 h + 4 j of destination word 32 b + 8 t + i.
  src = src.reshape(e, out, kp // PACK_BLOCK, 8, 4)  # [.., b, i, j]
  dst = np.zeros((e, out, kp // PACK_BLOCK, 4, 8), np.uint32)  # [.., b, t, i]
  for t in range(4):
    for h in range(2):
      for j in range(4):
        dst[..., t, :] |= ((src[..., j] >> np.uint32(4 * (2 * t + h))) & np.uint32(0xF)) << np.uint32(16 * h + 4 * j)
  scale_p = np.zeros((e, out, kp // GROUP_SIZE), scale.dtype)
  scale_p[..., :k // GROUP_SIZE] = scale
  return KernelInt4Matrix(words=jnp.asarray(dst.reshape(e, out, kp // 8)),
                          scale=jnp.asarray(scale_p, jnp.bfloat16), in_features=k)


def kernel_experts(experts: Int4Experts) -> Int4Experts:
  """``Int4Experts`` of ``Int4Matrix`` -> of ``KernelInt4Matrix`` (what the kernel and model hold)."""
  return Int4Experts(*(to_kernel_layout(m) for m in (experts.gate, experts.up, experts.down)))


def kernel_layout_values(words, in_features: int):
  """int32 values -8..7 [..., N, K] of packed ``words`` [..., N, Kp / 8] (plain jnp)."""
  *lead, n, w = words.shape
  kp = w * 8
  nib = (words.reshape(*lead, n, kp // PACK_BLOCK, 4, 8)[..., None, None] >> _nibble_shifts()) & 0xF  # [.., b, t, i, h, j]
  nd = len(lead) + 1
  perm = tuple(range(nd + 1)) + (nd + 2, nd + 4, nd + 1, nd + 3)  # -> [.., b, i, j, t, h]
  values = nib.transpose(perm).reshape(*lead, n, kp).astype(jnp.int32) - 8
  return values[..., :in_features]


def from_kernel_layout(m: KernelInt4Matrix) -> Int4Matrix:
  q = kernel_layout_values(m.words, m.in_features).astype(jnp.int4)
  scale = jnp.swapaxes(m.scale[..., :m.in_features // GROUP_SIZE], 1, 2)
  return Int4Matrix(q=q, scale=scale)
