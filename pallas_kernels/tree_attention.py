"""Tree-verify attention as a Pallas kernel for the Mosaic GPU backend (Hopper: TMA, wgmma).

Semantics are exactly those of ``pallas_kernels.reference`` (``mla_tree_attention``,
``mha_tree_attention``): a window of ``Q`` rows attends to its request's committed prefix
``[0, prefix_len)`` (real rows only) and to the window columns ``[prefix_len, prefix_len + Q)``
through ``ddtree_jax.tree.window_mask`` (here read bit-packed, ``tree.window_mask_bits``); a padded
row sees only its own column.

Layout of the work (why it is shaped this way):
  * Rows. The ``Q x heads`` query rows of one request (one KV group) share every key, so they are
    folded into one row axis and cut into tiles of ``rows_per_tile`` rows; each KV tile brought
    into shared memory serves all rows of a row tile at once.
  * Transposed products. With 8 heads a tree of 9 nodes has only 72 rows, far fewer than the 64-row
    minimum of a wgmma M dimension per tile, so the kernel computes scores transposed,
    ``S^T[kv, rows] = K Q^T`` (KV positions on M, rows on N, which only needs multiples of 8), and
    the output transposed, ``O^T[dv, rows] = V^T P^T``. Both are wgmma with operands in shared
    memory; the softmax reduces over axis 0. ``O^T`` lives in registers: ``dv x rows_per_tile / 128``
    fp32 registers per thread, which is what bounds ``rows_per_tile`` (32 for Kimi's 512-wide latent).
  * Threads. Each CTA runs one compute warpgroup and one memory warpgroup. The memory warpgroup
    streams KV tiles with TMA into a ring of shared-memory stages while the compute warpgroup works
    on the previous one (the tile assignment is written for several compute warpgroups taking
    alternate tiles, but a second one is not safe yet: see ``Plan.compute_wgs``).
  * Split KV. The grid is ``(request x group, split, row tile)``; each request's live columns
    ``[0, min(prefix_len + Q, T))`` are cut into ``num_splits`` equal tile-aligned ranges, so batch 1
    still fills the GPU; tiles past a request's length are never read. Each split writes a
    normalised partial output and its base-2 log-sum-exp; a small XLA epilogue merges them.
  * Masks. Columns below ``prefix_len`` need only ``col < prefix_cut[row]`` (``prefix_len`` for real
    rows, 0 for padded ones); only the one or two tiles that reach the window evaluate the packed
    visibility bits.

Inputs may be float32 or bfloat16; products run in bfloat16 with float32 accumulation (casting a
float32 cache pool copies it, so bf16 pools are the fast path); the probabilities are rounded to
bf16 for the second product, as in FlashAttention. Forward only (no VJP). Feature widths that are not
multiples of the wgmma tile are zero-padded here, which also copies the pool (a slow path: Kimi
and the demo model need none).
"""

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_jax.tree import window_mask_bits

LOG2E = math.log2(math.e)
BLOCK_KV = 64  # KV positions per tile: the wgmma M dimension of S^T
SMEM_BUDGET = 220 * 1024  # bytes of shared memory we allow ourselves (H100/H200 allow 227 KiB)
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4  # Mosaic GPU's default cross-warp reduction scratch


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static tiling of one call (see ``plan``)."""

  rows_per_tile: int
  num_row_tiles: int
  swizzle: int  # bytes; 64 or 128
  num_stages: int
  num_splits: int
  rows_stored: int  # columns of O^T written per partial (< rows_per_tile only for one small tile)
  # Compute warpgroups per CTA; they would take alternate KV tiles. One: Mosaic GPU places a
  # cross-warp reduction's shared-memory scratch at a static offset, so two warpgroups running the
  # same softmax code share one scratch buffer and race on it (seen on the H200: wrong outputs and
  # NaNs with two). A second warpgroup needs its own scratch offset first.
  compute_wgs: int = 1
  partial_dtype: str = "float32"  # of the per-(split, warpgroup) outputs the epilogue merges

  @property
  def num_parts(self) -> int:
    return self.num_splits * self.compute_wgs


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _num_sms() -> int:
  try:
    device = jax.devices()[0]
    if device.platform == "gpu":
      return int(device.core_count)
  except Exception:  # pragma: no cover - no backend at all
    pass
  return 132  # an H100/H200; only the split heuristic uses it


def plan(*, q_len: int, heads_per_group: int, num_work: int, key_dims, value_dim: int,
         shared_value: bool, cache_len: int, num_splits: int | None = None,
         partial_dtype: str = "float32") -> Plan:
  """Block sizes for one call, from a small table keyed by the row count per request.

  Args:
    q_len, heads_per_group: rows per request (and KV group) are ``q_len * heads_per_group``.
    num_work: requests x KV groups (independent row sets).
    key_dims: padded widths of the key parts (MLA: latent and rope); value_dim: padded value width.
    shared_value: the values are key part 0 (absorbed MLA), so a stage holds no separate V tile.
    cache_len: T, columns of the cache pool.
    num_splits: force the KV split count (tests, tuning); default from the SM count.
    partial_dtype: "float32" (default) or "bfloat16" (half the epilogue's traffic, adds one bf16
      rounding of each partial output).
  """
  compute_wgs = Plan.compute_wgs
  if partial_dtype not in ("float32", "bfloat16"):
    raise ValueError(f"partial_dtype must be 'float32' or 'bfloat16', got {partial_dtype!r}")
  rows = q_len * heads_per_group
  # Register budget of one compute warpgroup (128 threads): O^T takes value_dim * rows / 128 and
  # S^T / P^T take 64 * rows / 128 fp32 registers per thread; keep both under ~160.
  max_rows = max(32, (160 * 128) // (value_dim + BLOCK_KV))
  dims = list(key_dims) + [value_dim]
  # The swizzle must divide every contraction width and the row tile (P^T is stored [kv, rows]).
  candidates = []
  for rt in (32, 64, 96, 128):
    if rt > max_rows or rt > 256:
      continue
    for swizzle in (128, 64):
      elems = swizzle // 2
      if rt % elems == 0 and all(d % elems == 0 for d in dims):
        candidates.append((rt, swizzle))
        break
  if not candidates:
    raise ValueError(f"no row tile fits value_dim={value_dim} and key dims {key_dims}")
  # The largest tile whose padding stays within 15% of the least padded choice: padded rows cost
  # tensor-core work, while every extra row tile re-reads the request's KV (from L2 at best).
  least = min(_round_up(rows, rt) for rt, _ in candidates)
  rt, swizzle = max((c for c in candidates if _round_up(rows, c[0]) <= 1.15 * least),
                    key=lambda c: c[0])
  num_row_tiles = -(-rows // rt)
  key_width = sum(key_dims)
  stage_bytes = BLOCK_KV * (key_width + (0 if shared_value else value_dim)) * 2
  fixed_bytes = (rt * key_width * 2 + compute_wgs * BLOCK_KV * rt * 2 + 8 * rt * 4 +
                 compute_wgs * REDUCTION_SCRATCH_BYTES + 2048)
  # A multiple of the warpgroup count, so that each stage is only ever awaited by one warpgroup.
  num_stages = 2
  while fixed_bytes + (num_stages + 2) * stage_bytes <= SMEM_BUDGET and num_stages < 4:
    num_stages += 2
  if fixed_bytes + num_stages * stage_bytes > SMEM_BUDGET:
    raise ValueError(
        f"tree attention: a {BLOCK_KV}-row KV stage of width {key_width} does not fit shared "
        f"memory twice beside a {rt}-row query tile")
  if num_splits is None:
    tiles = -(-cache_len // BLOCK_KV)
    # One wave of at most one CTA per SM (shared memory holds one), each warpgroup keeping at
    # least one tile per split.
    num_splits = max(1, min(_num_sms() // (num_work * num_row_tiles), tiles // compute_wgs))
  rows_stored = min(rt, _round_up(rows, 8)) if num_row_tiles == 1 else rt
  return Plan(rows_per_tile=rt, num_row_tiles=num_row_tiles, swizzle=swizzle,
              num_stages=num_stages, num_splits=num_splits, rows_stored=rows_stored,
              compute_wgs=compute_wgs, partial_dtype=partial_dtype)


def _kernel(req_ref, meta_ref, *refs, plan: Plan, num_key_parts: int, shared_value: bool,
            num_groups: int, num_words: int, q_len: int, heads_per_group: int, cache_len: int,
            scale: float, interpreted: bool):
  """One CTA: request-group ``bg``, KV split ``split``, row tile ``rt``; 3 warpgroups.

  Refs (GMEM): req_ref int32[B, 3] (slot, window start, live length); meta_ref int32[BG, n_rt,
  1 + W, Rt] (prefix cut, packed window words); q parts [BG, rows, Dk_i]; key pools [S, T, G, Dk_i];
  value pool [S, T, G, Dv] unless shared with key part 0; outputs o_part [BG, n_rt, parts, Dv,
  rows_stored] and lse_part [BG, n_rt, parts, Rt]; then scratch.
  """
  n = num_key_parts
  q_refs = refs[:n]
  key_refs = refs[n:2 * n]
  rest = refs[2 * n:]
  if shared_value:
    value_ref, rest = key_refs[0], rest
  else:
    value_ref, rest = rest[0], rest[1:]
  o_ref, lse_ref = rest[0], rest[1]
  (key_smem, value_smem, q_smem, meta_smem, p_smem, loaded, consumed, q_barrier) = rest[2:]
  if shared_value:
    value_smem = key_smem[0]

  rt_rows = plan.rows_per_tile
  bk = BLOCK_KV
  num_stages = plan.num_stages

  bg = lax.axis_index("bg")
  split = lax.axis_index("split")
  row_tile = lax.axis_index("rt")
  wg = lax.axis_index("wg")
  b = lax.div(bg, num_groups)
  group = lax.rem(bg, num_groups)
  pool_slot = req_ref[b, 0]
  window_start = req_ref[b, 1]
  live = req_ref[b, 2]
  # Equal tile-aligned ranges of this request's live columns, one per split.
  per_split = lax.div(lax.div(live + plan.num_splits - 1, plan.num_splits) + bk - 1, bk) * bk
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, live)
  num_tiles = jnp.maximum(lax.div(hi - lo + bk - 1, bk), 0)
  # First tile that reaches the window (needs the packed visibility bits).
  before = window_start - lo - bk  # tile i reaches the window iff lo + (i + 1) * bk > window_start
  first_window_tile = jnp.clip(jnp.where(before < 0, 0, lax.div(before, bk) + 1), 0, num_tiles)

  def tile_start(i):
    """Nominal first column of tile i, and where its load starts (clamped inside the pool)."""
    nominal = lo + i * bk
    return nominal, jnp.minimum(nominal, cache_len - bk)

  cw = plan.compute_wgs

  @pl.when(wg == cw)
  def _memory_wg():
    plgpu.set_max_registers(40, action="decrease")
    row0 = row_tile * rt_rows
    for part in range(n):
      plgpu.copy_gmem_to_smem(q_refs[part].at[bg, pl.ds(row0, rt_rows)], q_smem[part], q_barrier)
    plgpu.copy_gmem_to_smem(meta_ref.at[bg, row_tile], meta_smem, q_barrier)

    def load(i, _):
      stage = lax.rem(i, num_stages)

      @pl.when(i >= num_stages)
      def _():
        plgpu.barrier_wait(consumed.at[stage])

      _, start = tile_start(i)
      for part in range(n):
        plgpu.copy_gmem_to_smem(key_refs[part].at[pool_slot, pl.ds(start, bk), group],
                                key_smem[part].at[stage], loaded.at[stage])
      if not shared_value:
        plgpu.copy_gmem_to_smem(value_ref.at[pool_slot, pl.ds(start, bk), group],
                                value_smem.at[stage], loaded.at[stage])

    lax.fori_loop(0, num_tiles, load, None)

    # Observe every completion of the consumed barriers before the kernel ends.
    def drain(i, _):
      plgpu.barrier_wait(consumed.at[lax.rem(i, num_stages)])

    lax.fori_loop(jnp.maximum(num_tiles - num_stages, 0), num_tiles, drain, None)

  @pl.when(wg < cw)
  def _compute_wg():
    plgpu.set_max_registers(232, action="increase")
    plgpu.barrier_wait(q_barrier)
    reduce0 = plgpu.Layout.WGMMA.reduce(0)
    prefix_cut = lax.broadcast_in_dim(plgpu.load(meta_smem.at[0], layout=reduce0), (bk, rt_rows),
                                      [1])
    kv_iota = plgpu.broadcasted_iota(jnp.int32, (bk, rt_rows), 0, layout=plgpu.Layout.WGMMA)
    p_buf = p_smem.at[wg]
    # Tiles wg, wg + cw, ...: the split between cheap and window tiles, counted in own tiles.
    own_tiles = jnp.maximum(lax.div(num_tiles - wg + cw - 1, cw), 0)
    own_cheap = jnp.minimum(lax.div(first_window_tile - wg + cw - 1, cw), own_tiles)
    own_cheap = jnp.maximum(own_cheap, 0)

    def visible_window(col):
      """Packed visibility bits of the window columns (col - window_start in [0, 32 W))."""
      rel = col - window_start
      seen = jnp.zeros((bk, rt_rows), jnp.bool_)
      for word in range(num_words):
        bits = lax.broadcast_in_dim(plgpu.load(meta_smem.at[1 + word], layout=reduce0),
                                    (bk, rt_rows), [1])
        shift = rel - 32 * word
        inside = (shift >= 0) & (shift < 32)
        bit = lax.shift_right_logical(bits, jnp.clip(shift, 0, 31)) & 1
        seen = seen | (inside & (bit != 0))
      return seen

    def step(j, carry, window: bool):
      acc, m_run, l_run = carry
      i = cw * j + wg
      stage = lax.rem(i, num_stages)
      nominal, start = tile_start(i)
      plgpu.barrier_wait(loaded.at[stage])

      def scores(acc_ref):
        for part in range(n):
          plgpu.wgmma(acc_ref, key_smem[part].at[stage], q_smem[part].transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((bk, rt_rows), jnp.float32))
      col = kv_iota + start
      vis = (col >= nominal) & (col < hi)
      in_prefix = col < prefix_cut
      if window:
        vis = vis & (in_prefix | visible_window(col))
      else:
        vis = vis & in_prefix
      s = jnp.where(vis, s * (scale * LOG2E), -jnp.inf)
      m_new = jnp.maximum(m_run, s.max(axis=0))
      # Rows that have seen no column yet keep m = -inf; exponentiate against 0 so no inf - inf.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m_run - m_safe)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [1]))
      l_run = l_run * alpha + p.sum(axis=0)
      p_buf[...] = p.astype(p_buf.dtype)
      plgpu.commit_smem()
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])

      def values(acc_ref):
        plgpu.wgmma(acc_ref, value_smem.at[stage].transpose((1, 0)), p_buf)

      acc = _accumulate(values, acc, interpreted)
      plgpu.barrier_arrive(consumed.at[stage])
      return acc, m_new, l_run

    def run_tiles(own_cheap, own_tiles, step):
      dv = value_smem.shape[-1]
      acc = plgpu.layout_cast(jnp.zeros((dv, rt_rows), jnp.float32), plgpu.Layout.WGMMA)
      m_run = plgpu.layout_cast(jnp.full((rt_rows,), -jnp.inf, jnp.float32), reduce0)
      l_run = plgpu.layout_cast(jnp.zeros((rt_rows,), jnp.float32), reduce0)
      carry = lax.fori_loop(0, own_cheap, functools.partial(step, window=False), (acc, m_run, l_run))
      acc, m_run, l_run = lax.fori_loop(own_cheap, own_tiles, functools.partial(step, window=True),
                                        carry)
      empty = l_run == 0.0
      inv_l = 1.0 / jnp.where(empty, 1.0, l_run)
      out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [1])
      lse = jnp.where(empty, -jnp.inf, m_run + jnp.log2(jnp.where(empty, 1.0, l_run)))
      part = split * cw + wg
      out = out.astype(o_ref.dtype)
      if plan.rows_stored < rt_rows:
        out = out[:, :plan.rows_stored]
      o_ref.at[bg, row_tile, part][...] = out
      lse_ref.at[bg, row_tile, part][...] = lse

    def loop_and_store():
      run_tiles(own_cheap, own_tiles, step)

    loop_and_store()


def _accumulate(issue, acc, interpreted: bool):
  """``acc + (what issue(acc_ref) adds)`` with the wgmma accumulating in place on the GPU.

  The GPU interpreter of jax 0.11 cannot run ``pl.run_state`` over an accumulator, so there the
  product goes into a fresh zero accumulator and is added in registers (same arithmetic).
  """
  if interpreted:
    def fresh(acc_ref):
      issue(acc_ref)
      return acc_ref[...]

    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
  return pl.run_state(issue)(plgpu.ACC.init(acc))


def _transforms(swizzle: int):
  return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _attend(q_parts, key_pools, value_pool, slots, prefix_len, visibility, valid, *, scale,
            q_len, heads_per_group, num_groups, interpret, num_splits=None,
            partial_dtype="float32"):
  """Runs the kernel on folded operands and merges the partials.

  Args:
    q_parts: bf16 [BG, rows, Dk_i] queries, rows = Q * heads_per_group (row = q * hpg + h).
    key_pools: bf16 [S, T, G, Dk_i]; value_pool: bf16 [S, T, G, Dv], or None when the values are
      key part 0 (absorbed MLA).
    slots, prefix_len: int32[B]; visibility: bool[B, Q, Q]; valid: bool[B, Q].
  Returns:
    float32 [BG, rows, Dv].
  """
  bg_count, rows = q_parts[0].shape[:2]
  cache_len = key_pools[0].shape[1]
  key_dims = [q.shape[-1] for q in q_parts]
  value_dim = (key_pools[0] if value_pool is None else value_pool).shape[-1]
  pl_ = plan(q_len=q_len, heads_per_group=heads_per_group, num_work=bg_count, key_dims=key_dims,
             value_dim=value_dim, shared_value=value_pool is None, cache_len=cache_len,
             num_splits=num_splits, partial_dtype=partial_dtype)
  rt_rows, n_rt = pl_.rows_per_tile, pl_.num_row_tiles
  rows_pad = rt_rows * n_rt
  q_parts = [jnp.pad(q, ((0, 0), (0, rows_pad - rows), (0, 0))) for q in q_parts]

  # Per-request scalars: pool slot, window start, live columns (the window may not overrun T).
  live = jnp.minimum(prefix_len + q_len, cache_len)
  req = jnp.stack([slots, prefix_len, live], axis=1).astype(jnp.int32)
  # Per-row metadata: prefix cut (prefix_len for real rows, 0 for padded rows) and packed bits.
  words = window_mask_bits(visibility, valid)  # [B, Q, W]
  num_words = words.shape[-1]
  cut = jnp.where(valid, prefix_len[:, None], 0).astype(jnp.int32)  # [B, Q]
  meta = jnp.concatenate([cut[..., None], words], axis=-1)  # [B, Q, 1 + W]
  meta = jnp.repeat(meta, heads_per_group, axis=1)  # [B, rows, 1 + W]
  meta = jnp.repeat(meta, num_groups, axis=0)  # [BG, rows, 1 + W] (bg = b * G + g)
  meta = jnp.pad(meta, ((0, 0), (0, rows_pad - rows), (0, 0)))
  meta = meta.reshape(bg_count, n_rt, rt_rows, 1 + num_words).transpose(0, 1, 3, 2)

  transforms = _transforms(pl_.swizzle)
  stages = pl_.num_stages
  shared_value = value_pool is None
  scratch = [
      tuple(plgpu.SMEM((stages, BLOCK_KV, d), jnp.bfloat16, transforms=transforms)
            for d in key_dims),
      None if shared_value else plgpu.SMEM((stages, BLOCK_KV, value_dim), jnp.bfloat16,
                                           transforms=transforms),
      tuple(plgpu.SMEM((rt_rows, d), jnp.bfloat16, transforms=transforms) for d in key_dims),
      plgpu.SMEM((1 + num_words, rt_rows), jnp.int32),
      plgpu.SMEM((pl_.compute_wgs, BLOCK_KV, rt_rows), jnp.bfloat16, transforms=transforms),
      plgpu.Barrier(num_arrivals=len(key_dims) + (0 if shared_value else 1),
                    num_barriers=stages),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      plgpu.Barrier(num_arrivals=len(key_dims) + 1),
  ]
  out_type = (
      jax.ShapeDtypeStruct((bg_count, n_rt, pl_.num_parts, value_dim, pl_.rows_stored),
                           jnp.dtype(pl_.partial_dtype)),
      jax.ShapeDtypeStruct((bg_count, n_rt, pl_.num_parts, rt_rows), jnp.float32),
  )
  body = functools.partial(
      _kernel, plan=pl_, num_key_parts=len(key_dims), shared_value=shared_value,
      num_groups=num_groups, num_words=num_words, q_len=q_len, heads_per_group=heads_per_group,
      cache_len=cache_len, scale=float(scale), interpreted=interpret is not None)
  kernel = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(bg_count, pl_.num_splits, n_rt), grid_names=("bg", "split", "rt"),
      num_threads=pl_.compute_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES),
      interpret=interpret)
  operands = [req, meta, *q_parts, *key_pools] + ([] if shared_value else [value_pool])
  o_part, lse_part = kernel(*operands)
  return _merge(o_part, lse_part, pl_, rows)


def _merge(o_part, lse_part, pl_: Plan, rows: int):
  """Log-sum-exp merge of the per-(split, warpgroup) partials.

  Args:
    o_part: [BG, n_rt, parts, Dv, rows_stored] normalised partial outputs (transposed).
    lse_part: float32 [BG, n_rt, parts, Rt] base-2 log-sum-exp (-inf for an empty part).
  Returns:
    float32 [BG, rows, Dv].
  """
  lse = lse_part[..., :pl_.rows_stored]
  top = jnp.max(lse, axis=2, keepdims=True)
  weight = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top))  # [BG, n_rt, parts, rs]
  # Written as a broadcast-multiply-reduce (not an einsum) so XLA fuses it into one reduction.
  total = jnp.sum(weight[:, :, :, None, :] * o_part.astype(jnp.float32), axis=2)  # [BG, n_rt, Dv, rs]
  out = total / jnp.sum(weight, axis=2)[:, :, None, :]
  bg_count, n_rt, dv = out.shape[:3]
  out = out.transpose(0, 1, 3, 2).reshape(bg_count, n_rt * pl_.rows_stored, dv)
  return out[:, :rows]


def _as_bf16(x):
  return x if x.dtype == jnp.bfloat16 else x.astype(jnp.bfloat16)


def _pad_last(x, multiple: int):
  extra = _round_up(x.shape[-1], multiple) - x.shape[-1]
  if not extra:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _pad_cache_len(pools, multiple: int, minimum: int):
  """TMA tiles need T >= one tile and tile-aligned clamped starts (T % 8 == 0); pad if not."""
  cache_len = pools[0].shape[1]
  target = max(_round_up(cache_len, multiple), minimum)
  if target == cache_len:
    return pools
  return [jnp.pad(p, [(0, 0), (0, target - cache_len)] + [(0, 0)] * (p.ndim - 2)) for p in pools]


def _check_window(name, slots, prefix_len, visibility, valid, batch, q_len):
  for arg, want, dtypes in (("slots", (batch,), "integer"), ("prefix_len", (batch,), "integer"),
                            ("visibility", (batch, q_len, q_len), "bool"),
                            ("valid", (batch, q_len), "bool")):
    x = {"slots": slots, "prefix_len": prefix_len, "visibility": visibility, "valid": valid}[arg]
    if tuple(x.shape) != want:
      raise ValueError(f"{name}: {arg} must have shape {want}, got {tuple(x.shape)}")
    if dtypes == "bool" and x.dtype != jnp.bool_:
      raise TypeError(f"{name}: {arg} must be bool, got {x.dtype}")
    if dtypes == "integer" and not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name}: {arg} must be an integer array, got {x.dtype}")


def _check_float(name, **arrays):
  for arg, x in arrays.items():
    if x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
      raise TypeError(f"{name}: {arg} must be bfloat16/float16/float32, got {x.dtype}")


def mla_tree_attention(q_latent, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid, *,
                       scale, interpret=None, num_splits=None, partial_dtype="float32"):
  """Absorbed-MLA tree attention over one layer's latent cache pool (Mosaic GPU kernel).

  Same contract as ``reference.mla_tree_attention``.

  Args:
    q_latent: [B, Q, N, R] queries in the latent space; q_rope: [B, Q, N, P].
    c_kv: [S, T, R] latent cache pool; k_pe: [S, T, P] roped keys.
    slots, prefix_len: int32[B]; visibility: bool[B, Q, Q]; valid: bool[B, Q].
    scale: softmax scale.
    interpret: None on the GPU; ``plgpu.InterpretGPUParams(...)`` runs the kernel on the CPU.
    num_splits: force the KV split count (tests, tuning); default from the SM count.
    partial_dtype: dtype of the per-split partial outputs ("float32" or "bfloat16").
  Returns:
    float32 [B, Q, N, R].
  """
  name = "mla_tree_attention"
  if q_latent.ndim != 4 or q_rope.ndim != 4 or c_kv.ndim != 3 or k_pe.ndim != 3:
    raise ValueError(
        f"{name}: expected q_latent [B,Q,N,R], q_rope [B,Q,N,P], c_kv [S,T,R], k_pe [S,T,P]; got "
        f"{q_latent.shape}, {q_rope.shape}, {c_kv.shape}, {k_pe.shape}")
  batch, q_len, heads, latent = q_latent.shape
  rope = q_rope.shape[-1]
  if q_rope.shape[:3] != (batch, q_len, heads):
    raise ValueError(f"{name}: q_rope {q_rope.shape} does not match q_latent {q_latent.shape}")
  if c_kv.shape[-1] != latent or k_pe.shape[-1] != rope or c_kv.shape[:2] != k_pe.shape[:2]:
    raise ValueError(f"{name}: pools c_kv {c_kv.shape}, k_pe {k_pe.shape} do not match queries "
                     f"(R={latent}, P={rope})")
  _check_float(name, q_latent=q_latent, q_rope=q_rope, c_kv=c_kv, k_pe=k_pe)
  _check_window(name, slots, prefix_len, visibility, valid, batch, q_len)
  # Value width is a wgmma M dimension (multiple of 64); key widths are contraction dims.
  c_kv_p, k_pe_p = _pad_last(_as_bf16(c_kv), 64), _pad_last(_as_bf16(k_pe), 32)
  c_kv_p, k_pe_p = _pad_cache_len([c_kv_p, k_pe_p], 8, BLOCK_KV)
  q_lat = _pad_last(_as_bf16(q_latent), 64).reshape(batch, q_len * heads, -1)
  q_rp = _pad_last(_as_bf16(q_rope), 32).reshape(batch, q_len * heads, -1)
  out = _attend([q_lat, q_rp], [c_kv_p[:, :, None], k_pe_p[:, :, None]], None,
                slots.astype(jnp.int32), prefix_len.astype(jnp.int32), visibility, valid,
                scale=scale, q_len=q_len, heads_per_group=heads, num_groups=1,
                interpret=interpret, num_splits=num_splits, partial_dtype=partial_dtype)
  return out[..., :latent].reshape(batch, q_len, heads, latent)


def mha_tree_attention(q, k, v, slots, prefix_len, visibility, valid, *, scale, interpret=None,
                       num_splits=None, partial_dtype="float32"):
  """Grouped/multi-head tree attention over one layer's K/V pool (Mosaic GPU kernel).

  Same contract as ``reference.mha_tree_attention``.

  Args:
    q: [B, Q, N, D]; k, v: [S, T, G, D] with N a multiple of G.
    slots, prefix_len, visibility, valid, scale, interpret, num_splits, partial_dtype: as in
      ``mla_tree_attention``.
  Returns:
    float32 [B, Q, N, D].
  """
  name = "mha_tree_attention"
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"{name}: expected q [B,Q,N,D], k and v [S,T,G,D]; got {q.shape}, "
                     f"{k.shape}, {v.shape}")
  batch, q_len, heads, dim = q.shape
  if k.shape != v.shape or k.shape[-1] != dim:
    raise ValueError(f"{name}: k {k.shape} and v {v.shape} must match and end in D={dim}")
  groups = k.shape[2]
  if heads % groups:
    raise ValueError(f"{name}: query heads {heads} not a multiple of kv heads {groups}")
  _check_float(name, q=q, k=k, v=v)
  _check_window(name, slots, prefix_len, visibility, valid, batch, q_len)
  rep = heads // groups
  k_p, v_p = _pad_last(_as_bf16(k), 64), _pad_last(_as_bf16(v), 64)
  k_p, v_p = _pad_cache_len([k_p, v_p], 8, BLOCK_KV)
  # Rows of one group: (q, r) for heads g * rep + r.
  qg = _pad_last(_as_bf16(q), 64).reshape(batch, q_len, groups, rep, -1)
  qg = qg.transpose(0, 2, 1, 3, 4).reshape(batch * groups, q_len * rep, -1)
  out = _attend([qg], [k_p], v_p, slots.astype(jnp.int32), prefix_len.astype(jnp.int32),
                visibility, valid, scale=scale, q_len=q_len, heads_per_group=rep,
                num_groups=groups, interpret=interpret, num_splits=num_splits,
                partial_dtype=partial_dtype)
  out = out[..., :dim].reshape(batch, groups, q_len, rep, dim).transpose(0, 2, 1, 3, 4)
  return out.reshape(batch, q_len, heads, dim)
