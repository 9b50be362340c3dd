"""Kimi K2.6 text decoder (DeepSeek-V3 architecture) in Flax NNX.

One code path serves the real 1T configuration and the tiny test models:
  * MLA with a latent cache: queries are absorbed into the 512-wide latent space (W_UK from
    ``kv_b_proj``), attention runs over ``c_kv`` and ``k_pe`` alone, and the output latent goes back
    through W_UV;
  * dropless MoE: sigmoid router in float32, ``e_score_correction_bias`` for selection only,
    normalised unbiased weights times the routed scale, one shared expert; tokens sorted by expert
    and computed by ``routed_experts`` (the function a GPU kernel replaces);
  * layers stacked (dense first, then MoE) and run with ``lax.scan``, the cache carried through.

Every forward is a window forward: ``Q`` query rows at explicit positions attend to each
request's committed prefix plus the window through a tree visibility mask (DESIGN §1.2). Plain
decoding is ``Q = 1``; a prefill chunk is a causal window.
"""

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models import cache as cache_lib
from models import int4
from models import ordering
from models import row_invariant
from models.config import KimiConfig
from pallas_kernels import reference


class RouterBias(nnx.Variable):
  """``e_score_correction_bias``: updated by load balancing, never by gradients."""


class QuantizedWeight(nnx.Variable):
  """INT4 routed-expert values and their scales (``cfg.experts_int4``): loaded, never trained."""


# Every variable a checkpoint holds.
CHECKPOINT_VARIABLES = (nnx.Param, RouterBias, QuantizedWeight)


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------
class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * row_invariant.rms_scale(x, self.eps)
    return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def _linear(cfg: KimiConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(
      d_in, d_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
      kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)


def yarn_inv_freq(cfg: KimiConfig):
  """Per-pair inverse frequencies [P/2] of the target's rope dimensions (YaRN where factor > 1)."""
  return yarn_inv_freq_of(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor,
                          cfg.rope_original_max_position_embeddings, cfg.rope_beta_fast, cfg.rope_beta_slow)


def yarn_inv_freq_of(dim: int, theta: float, factor: float, original_max_positions: int, beta_fast: float,
                     beta_slow: float):
  """Inverse frequencies [dim/2] of pair i (``theta**(-2i/dim)``) with YaRN's ramp between
  interpolation (divided by ``factor``) and extrapolation; plain RoPE where factor <= 1."""
  exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  extrapolated = 1.0 / (theta**exponents)
  if factor <= 1.0:
    return extrapolated
  interpolated = extrapolated / factor

  def correction_dim(num_rotations):
    return dim * math.log(original_max_positions / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(correction_dim(beta_fast)), 0)
  high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
  if low == high:
    high += 0.001  # avoid a zero-width ramp
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  extrapolate = 1.0 - ramp  # 1 for high-frequency pairs, which keep their original frequency
  return interpolated * (1.0 - extrapolate) + extrapolated * extrapolate


def apply_rope(x, positions, cfg: KimiConfig):
  """Rotates interleaved pairs (x[2i], x[2i+1]) by ``position * inv_freq[i]``.

  Args:
    x: [B, Q, N, P]; positions: int32[B, Q].
  Returns:
    Same shape and dtype; cos/sin carry YaRN's m(f, mscale) / m(f, mscale_all_dim).
  """
  angles = positions.astype(jnp.float32)[..., None] * yarn_inv_freq(cfg)  # [B, Q, P/2]
  cos = (jnp.cos(angles) * cfg.rope_cos_sin_scale)[:, :, None, :]
  sin = (jnp.sin(angles) * cfg.rope_cos_sin_scale)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  even, odd = x32[..., 0::2], x32[..., 1::2]
  rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Window:
  """Per-call attention context shared by every layer (not a parameter)."""

  positions: jax.Array  # int32[B, Q]
  visibility: jax.Array  # bool[B, Q, Q]
  valid: jax.Array  # bool[B, Q]
  slots: jax.Array  # int32[B]
  prefix_len: jax.Array  # int32[B], committed length per request


class MLAttention(nnx.Module):
  """Multi-head latent attention; decode/verify run the absorbed form over the latent cache."""

  def __init__(self, cfg: KimiConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    n = cfg.num_attention_heads
    self.q_a_proj = _linear(cfg, cfg.hidden_size, cfg.q_lora_rank, rngs)
    self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, cfg.param_dtype)
    self.q_b_proj = _linear(cfg, cfg.q_lora_rank, n * cfg.qk_head_dim, rngs)
    self.kv_a_proj_with_mqa = _linear(cfg, cfg.hidden_size, cfg.latent_dim, rngs)
    self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps, cfg.param_dtype)
    self.kv_b_proj = _linear(cfg, cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), rngs)
    self.o_proj = _linear(cfg, n * cfg.v_head_dim, cfg.hidden_size, rngs)

  def __call__(self, x, window: Window, c_kv_pool, k_pe_pool, attention_meta=None, slot_offset=None):
    """Attends a window over one layer's pools after writing the window's own latents.

    Args:
      x: [B, Q, H] normed hidden states.
      c_kv_pool: [S + 1, T, R]; k_pe_pool: [S + 1, T, P] (this layer's cache), or every layer's
        pools as one [L * (S + 1), T, .] array with this layer's slot s at row ``slot_offset + s``
        (``KimiModel.__call__``: the window is written into the whole cache in place, and the
        attention reads its slots there, so no layer's pool is copied out and back).
      attention_meta: the kernel's window metadata for this window (``_attention_window``),
        built once per forward and shared by every layer; None: the kernel builds it per call
        (and the "xla" reference needs none).
      slot_offset: int32 scalar added to the window's slots in the pools; None: 0.
    Returns:
      (out [B, Q, H], c_kv_pool, k_pe_pool) with the window rows written.
    """
    cfg = self.cfg
    b, q, _ = x.shape
    n, d_nope, d_rope, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.kv_lora_rank)
    query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(b, q, n, cfg.qk_head_dim)
    q_nope, q_pe = query[..., :d_nope], query[..., d_nope:]
    q_pe = apply_rope(q_pe, window.positions, cfg)

    compressed = self.kv_a_proj_with_mqa(x)  # [B, Q, R + P]
    c_kv = self.kv_a_layernorm(compressed[..., :r])
    k_pe = apply_rope(compressed[..., None, r:], window.positions, cfg)[:, :, 0]
    # Padded rows' latents are zeroed: masked columns get probability 0, but 0 * NaN is NaN, so
    # garbage in a padded row (whatever produced it) must never reach a real row's sum.
    c_kv = jnp.where(window.valid[..., None], c_kv, 0)
    k_pe = jnp.where(window.valid[..., None], k_pe, 0)
    slots, prefix_len = _attended_slots(window, has_pool=c_kv_pool is not None)
    if c_kv_pool is None:
      attend_c_kv, attend_k_pe = c_kv, k_pe
    else:
      if slot_offset is not None:
        slots = slots + slot_offset
        if attention_meta is not None:
          from pallas_kernels import tree_attention
          attention_meta = tree_attention.offset_window_slots(attention_meta, slot_offset)
      c_kv_pool = cache_lib.write_window(c_kv_pool, slots, window.prefix_len, c_kv)
      k_pe_pool = cache_lib.write_window(k_pe_pool, slots, window.prefix_len, k_pe)
      attend_c_kv, attend_k_pe = c_kv_pool, k_pe_pool

    w_kv_b = self.kv_b_proj.kernel[...].reshape(r, n, d_nope + cfg.v_head_dim)
    w_uk, w_uv = w_kv_b[..., :d_nope], w_kv_b[..., d_nope:]
    q_latent = jnp.einsum('bqnd,rnd->bqnr', q_nope, w_uk.astype(q_nope.dtype))
    attend = _attention_impl(cfg)
    extra = {} if attention_meta is None else {"window_meta": attention_meta}
    out_latent = attend(q_latent, q_pe, attend_c_kv, attend_k_pe, slots, prefix_len,
                        window.visibility, window.valid, scale=cfg.softmax_scale, **extra)
    out = jnp.einsum('bqnr,rnv->bqnv', out_latent.astype(x.dtype), w_uv.astype(x.dtype))
    return self.o_proj(out.reshape(b, q, n * cfg.v_head_dim)), c_kv_pool, k_pe_pool


def _attention_impl(cfg: KimiConfig):
  """The tree attention ``cfg.attention_impl`` selects; both share the reference's signature.

  "xla": the plain-jnp reference. "pallas": the Mosaic GPU kernel (forward only, no VJP). It needs a
  GPU backend (or ``plgpu.force_gpu_interpret_mode``, for tests, as ``moe_impl`` does): elsewhere
  this raises instead of silently running the kernel interpreter, which is far too slow for a model.
  """
  if cfg.attention_impl == "pallas":
    if jax.default_backend() != "gpu" and not _gpu_interpret_forced():
      raise RuntimeError(
          f"attention_impl='pallas' runs the Mosaic GPU kernel and needs a GPU backend, not "
          f"{jax.default_backend()!r}; use attention_impl='xla' here")
    # Imported here so that Mosaic GPU is only loaded when the kernel is selected.
    from pallas_kernels import tree_attention
    return tree_attention.mla_tree_attention
  return reference.mla_tree_attention


def _attention_window(cfg: KimiConfig, window: Window, pool_len: int | None, q_len: int):
  """The tree-attention kernel's window metadata for one forward, or None.

  It depends on the window and static shapes, not on the layer, so ``KimiModel.__call__`` builds
  it once, outside the layer scan, and every layer's kernel call reuses it
  (``tree_attention.prepare_mla_window``; bit for bit what each call would build itself). None
  for ``attention_impl="xla"``: the reference takes no metadata.

  Args:
    pool_len: T of the cache pool, or None without a cache (the window then attends to its own
      latents, ``_attended_slots``).
  """
  if cfg.attention_impl != "pallas":
    return None
  from pallas_kernels import tree_attention

  slots, prefix_len = _attended_slots(window, has_pool=pool_len is not None)
  return tree_attention.prepare_mla_window(
      slots, prefix_len, window.visibility, window.valid, heads=cfg.num_attention_heads,
      latent_dim=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
      cache_len=q_len if pool_len is None else pool_len)


def _attended_slots(window: Window, has_pool: bool):
  """(slots, prefix_len) int32[B] the attention reads: the window's own, or without a cache
  (training) a pool of one slot per row holding only the window's latents (slots 0..B-1, empty
  prefixes). One place, since the kernel's per-step metadata must match what each layer attends."""
  if has_pool:
    return window.slots, window.prefix_len
  batch = window.valid.shape[0]
  return jnp.arange(batch, dtype=jnp.int32), jnp.zeros((batch,), jnp.int32)


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: KimiConfig, width: int, rngs: nnx.Rngs):
    self.gate_proj = _linear(cfg, cfg.hidden_size, width, rngs)
    self.up_proj = _linear(cfg, cfg.hidden_size, width, rngs)
    self.down_proj = _linear(cfg, width, cfg.hidden_size, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def routed_experts(x_sorted, group_sizes, w_gate, w_up, w_down):
  """SwiGLU of every routed row through its expert; rows are sorted by expert.

  This is the one function a GPU grouped-matmul kernel replaces. ``ragged_dot`` is correct on
  every platform; rows past ``sum(group_sizes)`` (padding) come out as zeros.

  Args:
    x_sorted: [A, H] token rows, grouped by expert in expert order.
    group_sizes: int32[E] rows per expert.
    w_gate, w_up: [E, H, I]; w_down: [E, I, H].
  Returns:
    [A, H].
  """
  gate = jax.lax.ragged_dot(x_sorted, w_gate.astype(x_sorted.dtype), group_sizes)
  up = jax.lax.ragged_dot(x_sorted, w_up.astype(x_sorted.dtype), group_sizes)
  hidden = jax.nn.silu(gate) * up
  return jax.lax.ragged_dot(hidden, w_down.astype(x_sorted.dtype), group_sizes)


def _gpu_interpret_forced() -> bool:
  """Whether ``plgpu.force_gpu_interpret_mode`` is active (it has no public getter)."""
  from jax._src import config as jax_config

  flag = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
  return flag is not None and flag.value is not None


def _check_pallas_backend():
  if jax.default_backend() != "gpu" and not _gpu_interpret_forced():
    raise RuntimeError(
        f"moe_impl='pallas' runs the Mosaic GPU kernel and needs a GPU backend, not "
        f"{jax.default_backend()!r}; use moe_impl='xla' here")


def routed_experts_pallas(x_sorted, group_sizes, experts, sorted_expert_ids=None, per_row=None):
  """``routed_experts`` through the Mosaic GPU grouped-matmul kernel (``pallas_kernels/moe.py``).

  Same contract, with ``experts`` an ``int4.Int4Experts`` (read packed) or an
  ``int4.Bf16Experts`` of [E, in, out] weights; reads only the touched experts' weights. GPU only
  (or under ``plgpu.force_gpu_interpret_mode``, for tests), bf16 activations (the kernel raises a
  clear error otherwise). ``sorted_expert_ids`` int[A], each sorted row's expert (E for padding),
  lets the kernel build its work list from the rows where there are fewer rows than experts
  (decode and small trees): the same list, 0.92x the INT4 layer's GPU time at 384 experts and
  T = 1 and 9 on the H200 (``benchmarks/results/bench_moe_rows.md``); past it they give each
  row's place in the work layout by a gather instead of an [A, E] pass (0.7 ms a call at 384
  experts and T = 4096, ``benchmarks/results/bench_moe_prefill.md``). Up to 64 experts (an
  expert-parallel share) the gate/up kernel builds the list from ``group_sizes`` itself and the
  ids are not needed (``moe.default_work_list_impl``).
  """
  _check_pallas_backend()
  from pallas_kernels import moe  # the Mosaic GPU kernel; only this path needs it

  return moe.moe_experts(x_sorted, group_sizes, _kernel_experts(experts, x_sorted.dtype),
                         sorted_expert_ids=sorted_expert_ids, per_row=per_row)


def _kernel_experts(experts, dtype):
  """The experts as the kernel takes them: INT4 as they are (packed), bf16 weights in ``dtype``."""
  if isinstance(experts, int4.Int4Experts):
    return experts
  return int4.Bf16Experts(*(w.astype(dtype) for w in experts))


def route(router_logits, bias, valid, cfg: KimiConfig):
  """DeepSeek-V3 noaux_tc routing for one group.

  Args:
    router_logits: float32[M, E]; bias: float32[E]; valid: bool[M].
  Returns:
    (expert_ids int32[M, K] with E for padded rows, weights float32[M, K]).
  """
  scores = jax.nn.sigmoid(router_logits)
  _, expert_ids = jax.lax.top_k(scores + bias[None, :], cfg.num_experts_per_tok)
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  weights = weights * cfg.routed_scaling_factor
  expert_ids = jnp.where(valid[:, None], expert_ids, cfg.n_routed_experts)
  return expert_ids.astype(jnp.int32), weights


class MoE(nnx.Module):
  """Dropless routed experts plus shared expert."""

  def __init__(self, cfg: KimiConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    init = nnx.initializers.normal(cfg.initializer_range)
    self.gate = nnx.Param(init(rngs.params(), (h, e), cfg.param_dtype))  # router kernel [H, E]
    self.e_score_correction_bias = RouterBias(
        cfg.router_bias_init_std * jax.random.normal(rngs.params(), (e,), jnp.float32))
    if cfg.experts_int4:
      # The quantised initialisation in the kernel's packed layout (``int4.KernelInt4Matrix``):
      # uint32 words [E, out, Kp / 8] and bf16 scales [E, out, Kp / 32].
      gate, up, down = (int4.to_kernel_layout(int4.quantize_int4(init(rngs.params(), shape, jnp.float32)))
                        for shape in ((e, h, i), (e, h, i), (e, i, h)))
      self.experts_gate_words, self.experts_gate_scale = QuantizedWeight(gate.words), QuantizedWeight(gate.scale)
      self.experts_up_words, self.experts_up_scale = QuantizedWeight(up.words), QuantizedWeight(up.scale)
      self.experts_down_words, self.experts_down_scale = QuantizedWeight(down.words), QuantizedWeight(down.scale)
    else:
      self.experts_gate = nnx.Param(init(rngs.params(), (e, h, i), cfg.param_dtype))
      self.experts_up = nnx.Param(init(rngs.params(), (e, h, i), cfg.param_dtype))
      self.experts_down = nnx.Param(init(rngs.params(), (e, i, h), cfg.param_dtype))
    self.shared_experts = (MLP(cfg, i * cfg.n_shared_experts, rngs)
                           if cfg.n_shared_experts else None)

  def routed_weights(self):
    """``int4.Int4Experts`` of ``KernelInt4Matrix`` (``cfg.experts_int4``) or ``int4.Bf16Experts``
    of [E, in, out]."""
    if self.cfg.experts_int4:
      h, i = self.cfg.hidden_size, self.cfg.moe_intermediate_size
      return int4.Int4Experts(
          int4.KernelInt4Matrix(self.experts_gate_words[...], self.experts_gate_scale[...], h),
          int4.KernelInt4Matrix(self.experts_up_words[...], self.experts_up_scale[...], h),
          int4.KernelInt4Matrix(self.experts_down_words[...], self.experts_down_scale[...], i))
    return int4.Bf16Experts(self.experts_gate[...], self.experts_up[...], self.experts_down[...])

  def __call__(self, x, valid):
    """x: [B, Q, H]; valid: bool[B, Q]. Returns (out [B, Q, H], expert load int32[E])."""
    cfg = self.cfg
    b, q, h = x.shape
    tokens = x.reshape(b * q, h)
    logits = row_invariant.small_matmul(tokens, self.gate[...])
    expert_ids, weights = route(logits, self.e_score_correction_bias[...].astype(jnp.float32),
                                valid.reshape(-1), cfg)
    out, group_sizes = routed_block(tokens, expert_ids, weights, self.routed_weights(), cfg.moe_impl)
    if self.shared_experts is not None:
      out = out + self.shared_experts(tokens).astype(jnp.float32)
    return out.astype(x.dtype).reshape(b, q, h), group_sizes


# The block's two stable sorts (rows by expert; on the GPU, each token's rows for the combine) run
# as pairwise ranks on the GPU up to this many rows (M tokens x K experts; ``models.ordering``):
# XLA's GPU sort copies its operands and runs a few kernels, twice a layer. The limit is the one
# measured for the tree search's sets (``docs/engine_step.md``); in the block at the 48-expert share
# it saves a few microseconds a layer (``benchmarks/results/moe_block_ordering.md``).
MOE_ORDER_MAX_PAIRWISE = ordering.MAX_PAIRWISE


def routed_block(tokens, expert_ids, weights, experts, moe_impl: str = "xla", per_row: bool | None = None):
  """The routed half of an MoE layer: sort the (token, expert) rows by expert, run the experts,
  weight the rows and add them back to their tokens.

  Args:
    tokens: [M, H]; expert_ids: int32[M, K], E for rows routed nowhere (padded tokens; under
      expert parallelism, experts held elsewhere; any id outside [0, E), negative ones too, is
      taken as E); weights: float32[M, K].
    experts: ``int4.Bf16Experts`` [E, in, out] or ``int4.Int4Experts``; E is their first axis.
    moe_impl: "xla" (``routed_experts``, ragged_dot; INT4 dequantised per call) or "pallas"
      (``routed_experts_pallas``).
    per_row: "pallas" only: one work item per (token, slot), without the sort
      (``_routed_block_per_row``; the same result bit for bit); None (default): where M x K <=
      ``moe.PER_ROW_MAX_ROWS`` (one K2.6 token).
  Returns:
    (float32 [M, H], group_sizes int32[E]: rows routed to each expert).
  """
  if moe_impl not in ("xla", "pallas"):
    raise ValueError(f"moe_impl={moe_impl!r}: expected 'xla' or 'pallas'")
  m, k = expert_ids.shape
  e = jax.tree.leaves(experts.gate)[0].shape[0]
  # bincount would fold a negative id into expert 0, and the per-pair kernel path skips it.
  expert_ids = jnp.where((expert_ids < 0) | (expert_ids >= e), e, expert_ids)
  if m * k == 0:  # nothing routed (both impls alike; the kernel takes no empty call)
    return jnp.zeros(tokens.shape, jnp.float32), jnp.zeros((e,), jnp.int32)
  if moe_impl == "pallas":
    from pallas_kernels import moe  # the Mosaic GPU kernel; only this path needs it

    if per_row or (per_row is None and m * k <= moe.PER_ROW_MAX_ROWS):
      return _routed_block_per_row(tokens, expert_ids, weights, experts)
  flat_ids = expert_ids.reshape(-1)  # [M * K]; rows routed nowhere carry E and sort last
  order = ordering.stable_order(flat_ids, max_pairwise=MOE_ORDER_MAX_PAIRWISE)  # argsort(stable=True)
  token_of_row = order // k
  group_sizes = jnp.bincount(flat_ids, length=e + 1)[:e].astype(jnp.int32)
  if moe_impl == "pallas":
    y = routed_experts_pallas(tokens[token_of_row], group_sizes, experts, sorted_expert_ids=flat_ids[order],
                              per_row=per_row)
  else:
    if isinstance(experts, int4.Int4Experts):
      # The format's weights, bf16(q * scale), as the kernel forms them; dequantised per call
      # (the reference path: it reads every expert).
      experts = int4.dequantize_experts(experts, jnp.bfloat16)
    y = routed_experts(tokens[token_of_row], group_sizes, *experts)
  # Rows past sum(group_sizes) (routed nowhere: id E, sorted last) are zero by ragged_dot's
  # contract; the combines' `where` keeps them zero (and finite) even for a kernel that leaves
  # them unwritten.
  routed = jnp.arange(flat_ids.shape[0]) < jnp.sum(group_sizes)
  weight_of_row = weights.reshape(-1)[order]
  out = jax.lax.platform_dependent(y, token_of_row, weight_of_row, routed, cpu=functools.partial(scatter_add_rows, k=k),
                                   default=functools.partial(gather_add_rows, k=k))
  return out, group_sizes


def _routed_block_per_row(tokens, expert_ids, weights, experts):
  """``routed_block`` for one token (``moe.PER_ROW_MAX_ROWS`` pairs; "pallas"): each (token, slot)
  pair is its own work item (``moe_experts_per_row``), so there is no sort. Each token's rows are
  added in expert order, as the sorted path adds them, so the result is the same bit for bit;
  the order comes from comparing the token's K ids (elementwise, fused), not from a sort."""
  m, k = expert_ids.shape
  e = jax.tree.leaves(experts.gate)[0].shape[0]
  from pallas_kernels import moe

  _check_pallas_backend()
  y = moe.moe_experts_per_row(tokens, expert_ids, _kernel_experts(experts, tokens.dtype))  # [M, K, H]
  ids = jnp.minimum(expert_ids, e)  # routed nowhere: E, as the sorted path's padding
  # Slot j's place among its token's slots in (id, slot) order: a stable argsort of K ids.
  slot = jnp.arange(k)
  before = (ids[:, None, :] < ids[:, :, None]) | ((ids[:, None, :] == ids[:, :, None]) & (slot[None, :] < slot[:, None]))
  rank = jnp.sum(before, axis=2)  # [M, K]
  slot_of_rank = jnp.sum(jnp.where(rank[:, :, None] == slot[None, None, :], slot[None, :, None], 0), axis=1)
  rows_of_token = jnp.arange(m)[:, None] * k + slot_of_rank  # [M, K] flat pairs, expert order

  def scatter(y, rows_of_token, weight, routed):  # the CPU's combine, on rows in that order
    rows = rows_of_token.reshape(-1)
    return scatter_add_rows(y[rows], rows // k, weight[rows], routed[rows], k=k)

  out = jax.lax.platform_dependent(y.reshape(m * k, -1), rows_of_token, weights.reshape(-1),
                                   (ids < e).reshape(-1), cpu=scatter, default=_add_rows_in_order)
  # The expert loads as one small reduction (a bincount is a scatter and its initialisation).
  loads = jnp.sum(ids.reshape(-1)[None, :] == jnp.arange(e)[:, None], axis=1, dtype=jnp.int32)
  return out, loads


def scatter_add_rows(y, token_of_row, weight_of_row, routed, *, k: int):
  """float32 [M, H]: each token's weighted rows, added by a scatter-add in sorted order.

  Args: y [M * K, H] rows in sorted order; token_of_row int [M * K] (each sorted row's token);
  weight_of_row, routed [M * K]. The CPU's form: XLA adds there in update order, one row at a
  time. On the GPU a float scatter-add uses atomics, which add a token's rows in an order that
  changes from run to run (``gather_add_rows`` runs there).
  """
  rows = jnp.where(routed[:, None], y.astype(jnp.float32) * weight_of_row[:, None], 0.0)
  return jnp.zeros((token_of_row.shape[0] // k, y.shape[1]), jnp.float32).at[token_of_row].add(rows)


def gather_add_rows(y, token_of_row, weight_of_row, routed, *, k: int):
  """``scatter_add_rows`` without atomics (the GPU's form): each token gathers its k rows and adds
  them in sorted (expert) order, the CPU's order, in one elementwise fusion. A token's output
  depends only on its own rows, the same in every run and every batch (the Pallas kernel computes
  each row alike whatever the other rows). One stable sort of the rows' tokens finds each token's
  rows in sorted order."""
  m = token_of_row.shape[0] // k
  rows_of_token = ordering.stable_order(token_of_row, max_pairwise=MOE_ORDER_MAX_PAIRWISE).reshape(m, k)  # ascending
  return _add_rows_in_order(y, rows_of_token, weight_of_row, routed)


def _add_rows_in_order(y, rows_of_token, weight_of_row, routed):
  """float32 [M, H]: token m's weighted rows y[rows_of_token[m, 0]], [m, 1], ... added in that order."""
  m, k = rows_of_token.shape
  out = jnp.zeros((m, y.shape[1]), jnp.float32)
  for slot in range(k):
    row = rows_of_token[:, slot]
    out = out + jnp.where(routed[row, None], y[row].astype(jnp.float32) * weight_of_row[row, None], 0.0)
  return out


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: KimiConfig, moe: bool, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.self_attn = MLAttention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, cfg.intermediate_size, rngs)

  def __call__(self, x, window: Window, c_kv_pool, k_pe_pool, attention_meta=None, slot_offset=None):
    attn, c_kv_pool, k_pe_pool = self.self_attn(self.input_layernorm(x), window, c_kv_pool,
                                                k_pe_pool, attention_meta, slot_offset)
    x = x + attn
    normed = self.post_attention_layernorm(x)
    if isinstance(self.mlp, MoE):
      mlp, load = self.mlp(normed, window.valid)
    else:
      mlp, load = self.mlp(normed), None
    return x + mlp, c_kv_pool, k_pe_pool, load


def _layer_stack(cfg: KimiConfig, count: int, moe: bool, rngs: nnx.Rngs):
  if count == 0:
    return None

  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(layer_rngs):
    return DecoderLayer(cfg, moe, layer_rngs)

  return make(rngs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
  logits: jax.Array  # float32[B, R, V] for the requested rows
  features: jax.Array  # [B, Q, K, H]: outputs of the requested decoder layers
  expert_load: jax.Array  # int32[num_moe_layers, E]: routed rows per expert (real rows only)


class KimiModel(nnx.Module):
  """The decoder: embedding, ``first_k_dense_replace`` dense layers, MoE layers, norm, LM head."""

  def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(cfg.initializer_range)
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, embedding_init=init, rngs=rngs)
    self.dense_layers = _layer_stack(cfg, cfg.num_dense_layers, False, rngs)
    self.moe_layers = _layer_stack(cfg, cfg.num_moe_layers, True, rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
    self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs)

  def head(self, hidden):
    """Final norm + LM head: [..., H] -> float32 logits [..., V].

    The product accumulates into float32 and is never rounded to bf16: bf16 logits are spaced
    0.0625 apart near 10, which turns every close call into an exact tie broken by rounding noise.
    """
    normed = self.norm(hidden)
    if self.lm_head is None:
      table = self.embed_tokens.embedding[...]
      return jnp.einsum('...h,vh->...v', normed, table.astype(normed.dtype), preferred_element_type=jnp.float32)
    kernel = self.lm_head.kernel[...]
    return jnp.einsum('...h,hv->...v', normed, kernel.astype(normed.dtype), preferred_element_type=jnp.float32)

  def __call__(self, tokens, window: Window, cache: cache_lib.KVCache,
               feature_layers: Sequence[int] = (), logits_rows=None):
    """One window forward.

    Args:
      tokens: int32[B, Q].
      window: positions, visibility, valid, slots, prefix_len (see ``Window``).
      cache: the pool; the window's latents are written at ``prefix_len ..`` of each slot. None
        for training: the window then attends to itself alone.
      feature_layers: static 0-based layer ids whose outputs to return (id l = output of
        decoder layer l, i.e. HF's ``hidden_states[l + 1]``).
      logits_rows: optional int32[B, R] rows for which to compute logits (default: all Q).
    Returns:
      (ForwardOutput, cache).

    A bf16 forward with a cache and fewer than ``row_invariant.MIN_CPU_BATCH`` requests runs padded
    to that many on the CPU (rows without a request, in the scratch slot), so that a request's bits
    do not depend on how many are decoded with it (``docs/bf16_near_ties.md``).
    """
    batch = tokens.shape[0]
    if cache is None or not row_invariant.pads_small_batches(self.cfg.dtype, batch):
      return self._forward(tokens, window, cache, feature_layers, logits_rows)

    def padded(tokens, window, cache, logits_rows):
      extra = row_invariant.MIN_CPU_BATCH - batch
      tokens, window, logits_rows = _pad_batch(tokens, window, logits_rows, extra, cache.scratch_slot)
      out, cache = self._forward(tokens, window, cache, feature_layers, logits_rows)
      return ForwardOutput(logits=out.logits[:batch], features=out.features[:batch],
                           expert_load=out.expert_load), cache

    def plain(tokens, window, cache, logits_rows):
      return self._forward(tokens, window, cache, feature_layers, logits_rows)

    return jax.lax.platform_dependent(tokens, window, cache, logits_rows, cpu=padded, default=plain)

  def _forward(self, tokens, window: Window, cache: cache_lib.KVCache | None, feature_layers: Sequence[int] = (),
               logits_rows=None):
    """``__call__`` for the batch as given."""
    cfg = self.cfg
    x = self.embed_tokens(tokens)
    b, q, h = x.shape
    num_features = len(feature_layers)
    # Slot K of `features` is a sink for layers nobody asked for, so the scan body stays branch-free.
    feature_slot = [num_features] * cfg.num_hidden_layers
    for k, layer_id in enumerate(feature_layers):
      feature_slot[layer_id] = k
    feature_slot = jnp.asarray(feature_slot, jnp.int32)
    features = jnp.zeros((num_features + 1, b, q, h), x.dtype)
    # Every layer's pools as one array of L * (S + 1) slots (see the scan's body).
    pool_slots = None if cache is None else cache.c_kv.shape[1]
    carry = ((x, None, None, features) if cache is None else
             (x, cache.c_kv.reshape((-1,) + cache.c_kv.shape[2:]), cache.k_pe.reshape((-1,) + cache.k_pe.shape[2:]),
              features))
    # The attention kernel's window metadata, once per forward rather than once per layer.
    attention_meta = _attention_window(cfg, window, None if cache is None else cache.c_kv.shape[2], q)
    loads = []
    for stack, first in ((self.dense_layers, 0), (self.moe_layers, cfg.num_dense_layers)):
      if stack is None:
        continue
      graphdef, state = nnx.split(stack)
      count = jax.tree.leaves(state)[0].shape[0]

      def body(carry, xs, graphdef=graphdef):
        layer_state, layer_id = xs
        x, c_kv, k_pe, features = carry
        layer = nnx.merge(graphdef, layer_state)
        if c_kv is None:
          x, _, _, load = layer(x, window, None, None, attention_meta)
        else:
          # Every layer's pools as one array of L * (S + 1) slots (a reshape, no copy): the layer
          # writes its window into it in place and reads its slots there. Passing c_kv[layer_id]
          # would copy the layer's whole pool out and back every layer and step (all slots x T
          # columns, for a window of Q rows: the demo target's step took 14 -> 179 ms on the CPU
          # from 1 slot x 1024 columns to 16 x 4096, at batch 1).
          x, c_kv, k_pe, load = layer(x, window, c_kv, k_pe, attention_meta,
                                      slot_offset=layer_id * pool_slots)
        features = features.at[feature_slot[layer_id]].set(x)
        return (x, c_kv, k_pe, features), load

      layer_ids = jnp.arange(first, first + count, dtype=jnp.int32)
      carry, load = jax.lax.scan(body, carry, (state, layer_ids))
      if load is not None:
        loads.append(load)
    x, c_kv, k_pe, features = carry
    if logits_rows is not None:
      x = jnp.take_along_axis(x, logits_rows[:, :, None], axis=1)
    logits = self.head(x)
    expert_load = (loads[0] if loads else
                   jnp.zeros((0, cfg.n_routed_experts), jnp.int32))
    out = ForwardOutput(logits=logits, features=jnp.moveaxis(features[:num_features], 0, 2),
                        expert_load=expert_load)
    return out, (None if cache is None else dataclasses.replace(
        cache, c_kv=c_kv.reshape(cache.c_kv.shape), k_pe=k_pe.reshape(cache.k_pe.shape)))


def _pad_batch(tokens, window: Window, logits_rows, extra: int, scratch_slot: int):
  """``extra`` more batch rows that carry no request: invalid, in the scratch slot (where a
  forward writes their zeroed latents), after the real ones.

  Returns:
    (tokens, window, logits_rows) of B + extra rows, the real ones first.
  """
  q = tokens.shape[1]

  def pad(x, value):
    return jnp.concatenate([x, jnp.full((extra,) + x.shape[1:], value, x.dtype)])

  window = Window(positions=pad(window.positions, 0),
                  visibility=jnp.concatenate([window.visibility,
                                              jnp.broadcast_to(jnp.eye(q, dtype=bool), (extra, q, q))]),
                  valid=pad(window.valid, False), slots=pad(window.slots, scratch_slot),
                  prefix_len=pad(window.prefix_len, 0))
  return pad(tokens, 0), window, None if logits_rows is None else pad(logits_rows, 0)


def train_forward(model: KimiModel, tokens, valid=None, feature_layers: Sequence[int] = ()):
  """Causal forward over whole sequences without a cache (training and feature extraction).

  Args:
    tokens: int32[B, T]; valid: optional bool[B, T] (padding routes to no expert).
  Returns:
    ForwardOutput with logits float32[B, T, V].
  """
  b, t = tokens.shape
  valid = jnp.ones((b, t), bool) if valid is None else valid
  window = Window(positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                  visibility=jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)),
                  valid=valid, slots=jnp.zeros((b,), jnp.int32), prefix_len=jnp.zeros((b,), jnp.int32))
  out, _ = model(tokens, window, None, feature_layers=tuple(feature_layers))
  return out


def init_model(cfg: KimiConfig, seed: int = 0) -> KimiModel:
  return KimiModel(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: KimiConfig) -> KimiModel:
  """The model's shapes and dtypes, with no allocation (``jax.eval_shape`` underneath)."""
  return nnx.eval_shape(lambda: KimiModel(cfg, rngs=nnx.Rngs(0)))


def param_count(model: KimiModel) -> int:
  """Stored values of the checkpoint: parameters, ``e_score_correction_bias`` and, for INT4
  experts, their values and scales."""
  state = nnx.state(model, CHECKPOINT_VARIABLES)
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state))
