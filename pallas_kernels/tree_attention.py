"""Tree-verify attention as a Pallas kernel for the Mosaic GPU backend (Hopper: TMA, wgmma).

Semantics are exactly those of ``pallas_kernels.reference`` (``mla_tree_attention``,
``mha_tree_attention``): a window of ``Q`` rows attends to its request's committed prefix
``[0, prefix_len)`` (real rows only) and to the window columns ``[prefix_len, prefix_len + Q)``
through ``ddtree_jax.tree.window_mask`` (here read bit-packed, ``tree.window_mask_bits``); a padded
row sees only its own column.

Layout of the work (why it is shaped this way):
  * Rows. The ``Q x heads`` query rows of one request (one KV group) share every key, so they are
    folded into one row axis and cut into tiles of ``rows_per_tile`` rows; each KV tile brought
    into shared memory serves all rows of a row tile at once. Every row tile re-reads the
    request's KV, so the plan takes the fewest row tiles that fit (48 rows for Kimi: 136 rows of
    Q=17 in 3 tiles; 32-row tiles needed 5).
  * Two forms (``Options.form``; ``plan`` picks). "rows_m" (``_kernel_rows_m``, the default for
    Kimi from q_len 17 at 8 heads and from q_len 2 at 64 heads: at least 80 rows per group and no
    more row tiles than "rows_n") puts 64 query rows on the wgmma M side: ``S = Q K^T`` with Q [64, 576]
    and the KV tile [64, 576] both in shared memory, the softmax row-wise in registers (each
    row's 64 scores lie in one warp quad: shuffles, no shared memory), then ``O = P V`` with
    V = the tile's ``c_kv`` columns. Warpgroup 0 computes S, the softmax and ``O[:, :256]`` with P
    from registers, and hands P (bf16, one buffer) and the row rescale to warpgroup 1, which
    computes ``O[:, 256:]`` with P from shared memory; O [64, 512] fp32 is 128 registers per
    thread in each. Shared memory: the 73.7 KB query tile, two 73.7 KB KV stages and the 8 KB P:
    231504 bytes as Mosaic GPU allocated them, of the 232448 (227 KiB) a CTA may have; the
    planner's estimate (``_smem_bytes_rows_m``, small buffers rounded up to 1 KiB) is exactly
    232448, so it checks against the whole limit, not "rows_n"'s 220 KiB budget (which keeps room
    for the cross-warp reduction scratch "rows_m" does not use). No third stage, no second P
    buffer. H200 same-run, whole call (kernel) "rows_n" -> "rows_m", timed with an earlier build
    of this form (before a four-warpgroup variant was tried and removed; that build also took
    groups from 64 rows, now 80; the committed code passed the GPU tests, not re-timed): b1/32k/q17 42.3 (34.7) -> 39.5
    (32.0) us, q33 67.6 -> 53.3, q65 106.8 -> 84.8, h64/q9 117.8 -> 83.3, b1/128k/q17 117.7 ->
    104.1; q9 (72 rows, 2 tiles either way) 32.8 -> 35.7, so it stays "rows_n". A fourth
    warpgroup (softmax only, two value warpgroups) does not compile: ptxas builds the kernel for
    65536 / 512 = 128 registers per thread, and the [64, 256] fp32 wgmma needs 154.
  * Transposed products ("rows_n", ``_kernel``). With 8 heads a tree of 9 nodes has only 72 rows,
    far fewer than the 64-row minimum of a wgmma M dimension per tile, so the kernel computes
    scores transposed,
    ``S^T[kv, rows] = K Q^T`` (KV positions on M, rows on N, which only needs multiples of 8), and
    the output transposed, ``O^T[dv, rows] = V^T P^T``. Both are wgmma with operands in shared
    memory (P stored ``[rows, kv]``, K-major); the softmax reduces over axis 0.
  * Threads. Each CTA runs a memory warpgroup, which streams KV tiles with TMA into a ring of
    shared-memory stages, and one or two compute warpgroups. ``O^T`` lives in registers
    (``dv x rows_per_tile / 128`` fp32 per thread for one warpgroup). Warpgroup 0 computes
    ``S^T`` and the online softmax and hands ``P`` (double-buffered) and the per-row rescale
    factors to warpgroup 1 through shared memory; warpgroup 1 holds all of Kimi's 512 x 48
    ``O^T`` (192 fp32 per thread) and does all of ``V^T P^T`` (``Options.pv="value_wg"``), so
    warpgroup 0's per-tile chain is only S^T and the softmax. Where ``O^T`` does not fit one
    warpgroup, each owns half of Dv (``pv="split"``, the previous kernel: 37.2 vs 34.9 us at
    b1/32k/q17 on the H200, same run). Only warpgroup 0 reduces across warps, because Mosaic GPU
    gives every such reduction the same static scratch buffer.
    Shared memory, not registers, caps the row tile at 48: the query tile and two 73.7 KB KV
    stages leave room for no more.
  * Split KV. The grid is ``(request x group, split, row tile)``; each request's live columns
    ``[0, min(prefix_len + Q, T))`` are cut into ``num_splits`` equal tile-aligned ranges, so batch 1
    still fills the GPU; tiles past a request's length are never read. The split count minimises
    waves x tiles per CTA, so batch 8 with long trees runs several waves rather than one split per
    request. Each split writes a normalised partial output, as ``O`` ([rows, Dv], through a
    transposed view and the transposed WGMMA register layout; in "rows_m" with bf16 queries, by
    default, bf16 staged in the idle query tile and stored by one TMA copy, ``Options.epilogue``),
    and its base-2 log-sum-exp. One
    Mosaic GPU kernel merges them where it was timed faster (``_merge_kernel``: one CTA per real
    output row and block of columns, 256 by default and 128 below 64 merged rows, reads that block
    of every split with one TMA box and writes the final float32 block; ``Options.merge="auto"``
    takes it for 8..512 merged rows of fp32 partials and 64..520 of bf16, else the XLA merge,
    "pairwise": split weights, then one weighted-sum reduction, two kernels; "kernel" forces it
    wherever one block of every split fits a CTA's shared memory). H200, b1/32k/q17, same run, per layer: 35.5-35.6 us with the
    merge kernel (3.49 us of it; 4.06 with one CTA per whole row, the first design) against 37.9
    with the XLA merge (2.24 + 3.55 us); it moves the 12 MB of fp32 partials of the real rows.
    A plan with one split has nothing to merge: the partial is the output (no merge kernel).
    The launched split count comes from the pool's length (static); a short context in a long
    pool then gets many splits of two or three tiles. ``Options.live_splits`` splits each
    request by a count chosen at run time from the batch's live lengths instead (in the window
    metadata; the CTAs past it return at once and the merges select them away); on by default
    where more than one request-group (requests x KV groups) and more than one split run.
  * Masks. Columns below ``prefix_len`` need only ``col < prefix_cut[row]`` (``prefix_len`` for real
    rows, 0 for padded ones); only the one or two tiles that reach the window evaluate the packed
    visibility bits. Those per-row words and the request's slot, window start and length travel in
    one int32 array built by one XLA fusion (``_window_meta``). It depends on the window and the
    static shapes, not on the layer: ``prepare_mla_window`` / ``prepare_mha_window`` build it
    once per step as a ``WindowMeta`` that every layer's call takes as ``window_meta=`` (the
    model does this outside its layer scan; bit for bit the same result, one fusion per step
    instead of one per layer).
  * Softmax. The scores lie transposed, so the row max and sum reduce over the KV axis across
    the 4 warps (through shared memory, two warpgroup barriers per round). The denominators are
    kept as a [64, Rt] elementwise sum and reduced once after the loop, and the reduction scratch
    holds all of a row tile's columns, so each KV tile runs one reduction in one round.
  * What limits "rows_m" (H200, b1/32k/q17, same run): compute. Kernel 32.0 us, 31.5 with the
    loads left out, 27.0 with the P V products left out, 18.7 with all compute left out (the KV
    stream of 3 row tiles: each CTA waits ~1.5 us per 73.7 KB tile). So warpgroup 0's chain,
    S (2.4 M MACs, ~0.8 us at the measured matmul peak) then the softmax and hand-off, costs
    ~2 us per tile: the tensor cores idle during the softmax. The FlashAttention-3 remedy (issue
    S of tile i + 1 before the softmax of tile i) needs tile i + 1 resident while tile i is in
    use and its load started earlier, i.e. a third KV stage, which does not fit. The FlashMLA
    remedy (both warpgroups compute S for alternate tiles and exchange the row maxima) was
    built as a "seesaw" schedule: correct, and its kernel 1.20-1.39x slower in every cell
    timed (goal cell 41.8 against 30.0 us, ``bench_tree_attention_seesaw.md``; removed on
    2026-12-01, the code is in the history up to a381f5f). With one P buffer (no room for a
    second) warpgroup 1 must finish its product with P_a before it can hand over P_b, so each
    pair still runs both softmaxes and two products in one chain. The
    third row tile of q_len 17 (136 rows) holds 8 real rows of 64. A later run (same
    cell, ``bench_tree_attention_probes.md``): kernel 32.3 us, 31.6 without loads, 27.0 without
    P V, 18.7 without compute, and **20.4 without the partial-output stores** (probe "nostore";
    the outputs are then unused, so the compiler may also have dropped the P V products and
    rescales: the stores cost 5-12 us). Every thread stores its fp32 WGMMA fragments straight
    to global memory (bf16 partials stored that way were slower still). Since then the default
    (``Options.epilogue="auto"`` with ``partial_dtype="auto"``, bf16 queries) stages bf16
    partials in the query tile for one TMA store: kernel 29.8 us, per layer with the merge
    kernel 33.0 us (``bench_tree_attention_epilogue.md``). An estimate, not profiled: per
    64-column KV tile the wgmma operands read from shared memory are Q and K for S (73.7 KB
    each: Q is re-read for every tile, as no warpgroup has the 144 registers a thread to keep it)
    and V (with P) for the two halves of O (~72 KB), beside the tile's 73.7 KB TMA write: ~290 KB
    at 128 bytes a clock is ~1.2 us a tile, ~14 us for the goal cell's 12 tiles even with the
    softmax fully hidden, before the prologue, the stores and the 3 us merge, against a 11.7 us
    roofline (70% of it: 16.7 us). This tiling cannot reach the 70% goal there; the kernel takes
    ~2.2 us a tile.
  * What limits "rows_n" (H200, Kimi widths, b1/32k/q17; ``bench_tree_attention.md``): compute,
    not the KV stream. The kernel takes 34.8 us, 33.4 with the loads left out, 17.3 with the compute
    left out and 27.6 with the softmax left out, i.e. about 2.2 us of wgmma work per 64-column
    tile even without the softmax. Likely cause (not profiled): with the rows on the N side
    (N = 48), each tile re-reads the 55 KB query tile and, for each of V^T's 8 M-blocks, P^T from
    shared memory (~240 KB of operand reads per tile). Taking V^T P^T off warpgroup 0 gained 6%.
    S^T of tile i + 1 during the softmax of tile i needs tile i + 1 loaded while tile i is held,
    and a third 73.7 KB stage does not fit beside the query tile.
  * Tried and dropped (H200 measurements in ``benchmarks/results/bench_tree_attention.md``): a
    cluster of the row tiles of one split sharing each KV tile by TMA multicast (correct, but 1.2x
    to 4x slower: the cluster-wide stage release puts the CTAs in lockstep), a one-pass
    variadic-reduction merge (slower in XLA than the two-pass merge), and L2 prefetch of the next
    KV tiles (no gain at q_len 17, slower at q_len 1: the loads were not the limit).

Inputs may be float32 or bfloat16; products run in bfloat16 with float32 accumulation (casting a
float32 cache pool copies it, so bf16 pools are the fast path); the probabilities are rounded to
bf16 for the second product, as in FlashAttention. Forward only (no VJP). Feature widths that are not
multiples of the wgmma tile are zero-padded here, which also copies the pool (a slow path: Kimi
and the demo model need none).
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from ddtree_jax.tree import window_mask_bits
from pallas_kernels.forward_only import forward_only
from pallas_kernels.gpu_info import interpret_params, num_sms, pdl_prologue

LOG2E = math.log2(math.e)
BLOCK_KV = 64  # KV positions per tile: the wgmma M dimension of S^T
# Registers a thread at launch for three warpgroups (65536 / 384, down to a multiple of 8);
# setmaxnreg can only move registers between warpgroups within the CTA's 3 x 168.
LAUNCH_REGISTERS = 168
SMEM_BUDGET = 220 * 1024  # bytes of shared memory we allow ourselves (H100/H200 allow 227 KiB)
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4  # Mosaic GPU's default cross-warp reduction scratch


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static tiling of one call (see ``plan``)."""

  rows_per_tile: int
  num_row_tiles: int
  # Bytes, of every shared-memory operand: KV stages and query tile (minor dim: features) and
  # P (minor dim: the 64 KV positions). P^T meets V^T in one wgmma, and Mosaic GPU wants one
  # swizzle for both operands; P is stored [Rt, 64] (K-major for the wgmma) so that any row tile
  # that is a multiple of 8 works (P^T stored [64, Rt] would tie Rt to the swizzle width).
  swizzle: int
  num_stages: int
  num_splits: int
  rows_stored: int  # rows of O written per partial (< rows_per_tile only for one small tile)
  # Cross-warp reduction scratch. A reduction of S^T over its KV axis stages 1 KiB per 8 columns
  # (4 warps x 32 lanes x 2 floats) and runs as many rounds, each with two warpgroup barriers, as
  # the scratch needs to hold them all: Rt * 128 bytes make it one round (3 at Rt=48 by default).
  # "rows_n" only; "rows_m" reduces within warp quads and has 0 here.
  reduction_scratch: int
  # Compute warpgroups. Warpgroup 0 alone computes S^T and the softmax and hands P and the
  # rescale factors to warpgroup 1 through shared memory: only one warpgroup ever runs a
  # cross-warp reduction (Mosaic GPU gives every reduction the same static shared-memory
  # scratch, so two reducing warpgroups would race). Who accumulates O^T is ``options.pv``:
  # warpgroup 1 alone (Kimi's 512 x 48 tile: 192 fp32 per thread) or half of Dv each. In
  # "rows_m" there are always two, each owning half of Dv.
  value_wgs: int
  partial_dtype: str = "float32"  # of the per-split outputs the epilogue merges
  options: "Options" = None  # see ``Options``; as ``plan`` resolved them
  # "rows_n": the transposed kernel (rows on the wgmma N side, ``_kernel``); "rows_m": 64 query
  # rows on the M side (``_kernel_rows_m``, see ``Options.form``).
  form: str = "rows_n"

  @property
  def live_splits(self) -> bool:
    """Whether this call runs ``Options.live_splits``: as ``plan`` resolved it. A Plan built by
    hand with "auto" has no batch to resolve it with and runs without (every split written)."""
    return self.options is not None and self.options.live_splits is True


@dataclasses.dataclass(frozen=True)
class Options:
  """Kernel variants the benchmark measures side by side (defaults: the committed choice).

  lazy_sum: keep the softmax denominators as a [64, Rt] elementwise sum and reduce it over the KV
    axis once after the loop, so each KV tile runs one cross-warp reduction (the max), not two
    (``plan`` turns it off where the extra registers do not fit).
    H200, Kimi widths: 43.7 -> 39.2 us kernel at b1/32k/q17, 511 -> 423 us at b1/128k/q65.
  pv: who multiplies V^T P^T when there are two compute warpgroups. "value_wg": warpgroup 1
    alone, over all of Dv, so that warpgroup 0's per-tile chain is only S^T and the softmax
    (it runs ahead by up to two tiles while warpgroup 1 multiplies); "split": each warpgroup
    half of Dv (the previous kernel); "auto": "value_wg" where warpgroup 1's registers hold all
    of O^T (Dv * Rt / 128 <= 192 fp32 per thread), else "split". Form "rows_m" takes only
    "split"/"auto" (see ``_plan_rows_m`` for why a softmax-only warpgroup does not compile).
  regs: registers per thread of warpgroups 0 and 1 (setmaxnreg; with the memory warpgroup's 40
    at most 504 in all: the CTA is launched with 168 a thread, 3 x 168 = 504, and setmaxnreg only
    moves registers within that allocation; 240/232, 248/224 and 256/216, at 512, hung the H200
    on 2026-11-30); 0: 232 each. In form "rows_m" at Kimi widths (goal cell) ptxas spills 148
    bytes a thread in warpgroup 0 at 232, 108 at 240, 76 at 248, 48 at 256, and warpgroup 1 none
    at 208 (the kernel's PTX through ptxas 13.0 offline).
    Non-zero counts no longer steer form "auto" to "rows_n" (until 2026-11-30 "rows_m" refused
    them); the counts split different work in each form (rows_m: S and half of O in warpgroup 0).
  merge: "auto" (default: "kernel" for ``MERGE_KERNEL_ROWS`` merged rows, or
    ``MERGE_KERNEL_ROWS_BF16`` with bf16 partials, where it was timed faster, else "pairwise"),
    "kernel" (one Mosaic GPU kernel, ``_merge_kernel``, reads each real row's partials, by
    blocks of ``merge_columns``, and log-sum-exps and writes the final float32 rows; where a
    block of every split does not fit its shared memory or is not a multiple of 128 columns,
    ``_merge_kernel_fits``, the "pairwise" XLA merge runs instead),
    "pairwise" (XLA: each split's weight 1 / sum_t 2^(lse_t - lse_s) in one fusion, and one
    weighted sum: two kernels) or "two_pass" (XLA: max, then exponentials and sums: three).
  form: which kernel. "rows_n": the query rows on the wgmma N side (S^T = K Q^T, O^T = V^T P^T;
    row tiles of any multiple of 8; ``_kernel``); "rows_m": 64 query rows per tile on the M side
    (S = Q K^T with both operands in shared memory, O = P V with V from shared memory, each of
    two warpgroups owning half of Dv; ``_kernel_rows_m``); "auto": "rows_m" where it applies (Dv
    a multiple of 128, at most 512) and a group has at least ``rows_m_min`` rows, else "rows_n".
  rows_m_min: rows per group (q_len x heads per group) from which "auto" takes "rows_m".
  merge_columns: output columns per merge-kernel CTA, 0 (``MERGE_COLUMNS``, or
    ``MERGE_COLUMNS_FEW_ROWS`` below ``FEW_MERGED_ROWS`` merged rows) or a multiple of 128 (see
    ``_merge_columns``).
  epilogue: how "rows_m" writes each split's partial output. "registers": every thread stores its
    WGMMA fragments straight to global memory. "smem" (bf16 partials, query width = Dv): each
    compute warpgroup writes its half of O into the query tile's first part, idle once warpgroup
    0 has computed its last S, and stores it with one TMA copy. "auto" (default): "smem" where
    the partials are bf16 and it applies, else "registers". H200, h8 b1 32k, same run, bf16
    partials: kernel 29.8 / 44.5 / 76.6 us at q17 / q33 / q65 staged, 35.0 / 49.3 / 79.7 from
    registers (fp32 partials from registers: 32.1 / 46.6 / 77.3;
    ``bench_tree_attention_epilogue``). "rows_n" takes "auto" and "registers" only.
  probe: timing probes that give wrong results: "noload" (after the first stages the memory
    warpgroup only signals the stages, no copies: compute alone), "nocompute" (the compute
    warpgroups only wait for each tile and release it: the KV stream alone), "nosoftmax" (P = S,
    no masks, reductions or exponentials; form "rows_n" only), "nopv" (no V^T P^T products),
    "nostore" (the partial outputs are computed but not written; form "rows_m" only).
  live_splits: split each request's live columns by a count chosen from the live lengths at run
    time (capped at the launched ``num_splits``, which the pool's length sets), not by the
    launched count: a short context in a long pool then runs few long splits instead of many of
    two or three tiles. The counts are chosen for the whole batch by the launched count's cost
    model (``_live_split_counts``: a long request keeps its splits, short ones beside it take
    few) and go into the window metadata; the CTAs of the splits past a request's count return at
    once, loading and storing nothing, and both merges select those splits away (their partials
    are never written; the merge still reads every launched split's). True, False, or "auto"
    (default): on where the grid holds more than one request-group and more than one split is
    launched. H200, same run, per layer, on against off (``bench_tree_attention_live.md``): at
    batch 8 and 32, 0.78x at h64 b8 4k q17 in a 132k pool (257 against 328 us), 0.85x, 0.92x
    and 1.00x in batches of mixed lengths, 0.92-1.01x in the other uniform cells; at batch 1 it
    only added the count's read to the merge (h8 b1 4k q17 15.2 against 13.3 us, the same kernel
    time), so "auto" leaves it off there (MLA; MHA with several KV groups has several
    request-groups at batch 1, so it is on there, untimed). A request's count then depends on its
    batch-mates' lengths, so its rounding does too (the near-tie rule covers it, as it covers the
    batch size's effect on the launched count).
  """

  lazy_sum: bool = True
  pv: str = "auto"
  merge: str = "auto"
  reduction_scratch: int = 0  # bytes of cross-warp reduction scratch; 0: as much as helps and fits
  regs: tuple = (0, 0)
  form: str = "auto"
  rows_m_min: int = 80
  merge_columns: int = 0
  epilogue: str = "auto"
  probe: str = ""
  live_splits: bool | str = "auto"
  # Programmatic dependent launch for the attention and merge kernels (``gpu_info.pdl_prologue``):
  # each may launch while the kernel before it finishes, and waits for it before any read. H200:
  # no gain in five heads-8 cells (benchmarks/results/pdl.md: XLA's command buffer leaves no
  # launch gaps between the kernels), so off.
  pdl: bool = False


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _swizzle_for(*widths: int) -> int | None:
  """The widest TMA/wgmma swizzle (bytes) whose bf16 span divides every minor width given."""
  for swizzle in (128, 64, 32):
    if all(w % (swizzle // 2) == 0 for w in widths):
      return swizzle
  return None


def _smem_bytes(rt: int, key_width: int, value_width: int, num_words: int, num_stages: int,
                scratch: int = REDUCTION_SCRATCH_BYTES) -> int:
  """Shared memory of one CTA; small buffers count a whole 1 KiB (allocation alignment)."""
  small = lambda nbytes: _round_up(nbytes, 1024)
  return (num_stages * BLOCK_KV * (key_width + value_width) * 2  # KV ring
          + rt * key_width * 2  # query tile
          + 2 * BLOCK_KV * rt * 2  # P^T, double-buffered
          + small((1 + num_words) * rt * 4) + small(3 * rt * 4) + 1024  # metadata, exchange, barriers
          + scratch)


ROWS_M = 64  # query rows per tile of the "rows_m" form: the wgmma M dimension
SMEM_LIMIT = 227 * 1024  # what Mosaic GPU lets one CTA allocate on the H100/H200


def _smem_bytes_rows_m(key_width: int, value_width: int, num_words: int, num_stages: int) -> int:
  """Shared memory of one CTA of the "rows_m" form (each buffer a whole 1 KiB, as allocated).

  KV ring, query tile, P (one [64, 64] bf16 buffer), metadata and the rescale exchange, and 1 KiB
  for the barriers. No reduction scratch: the softmax reduces within warp quads.
  """
  small = lambda nbytes: _round_up(nbytes, 1024)
  return (num_stages * BLOCK_KV * (key_width + value_width) * 2 + ROWS_M * key_width * 2
          + ROWS_M * BLOCK_KV * 2 + small((1 + num_words) * ROWS_M * 4) + small(2 * ROWS_M * 4)
          + 1024)


def _rows_m_applies(value_dim: int) -> bool:
  """Each of two warpgroups owns Dv / 2 columns of O: a wgmma N of at most 256, whole 64s."""
  return value_dim % 128 == 0 and value_dim <= 512


def plan(*, q_len: int, heads_per_group: int, num_work: int, key_dims, value_dim: int,
         shared_value: bool, cache_len: int, num_splits: int | None = None,
         partial_dtype: str = "auto", rows_per_tile: int | None = None,
         options: Options | None = None, query_dtype=None) -> Plan:
  """Block sizes for one call, chosen from the register and shared-memory budgets.

  Args:
    q_len, heads_per_group: rows per request (and KV group) are ``q_len * heads_per_group``.
    num_work: requests x KV groups (independent row sets).
    key_dims: padded widths of the key parts (MLA: latent and rope); value_dim: padded value width.
    shared_value: the values are key part 0 (absorbed MLA), so a stage holds no separate V tile.
    cache_len: T, columns of the cache pool.
    num_splits: force the KV split count (tests, tuning); default ``_choose_splits``.
    partial_dtype: "float32", "bfloat16" (half the epilogue's traffic, adds one bf16 rounding of
      each partial output) or "auto" (default): "bfloat16" where the queries (``query_dtype``)
      are bf16 and form "rows_m" stages the outputs in shared memory (``Options.epilogue``:
      where query part 0 is as wide as the values, as in absorbed MLA and MHA), where it was
      timed faster (MLA);
      else "float32". It never changes the row tiles, so window metadata built with "auto" and
      no ``query_dtype`` serves every call.
    rows_per_tile: force the row tile (tests, tuning); default: fewest row tiles that fit.
    options: kernel variants (``Options``); default ``Options()``.
    query_dtype: the queries' dtype, for ``partial_dtype="auto"`` (None: not bf16).
  """
  options = Options() if options is None else options
  if options.probe not in ("", "noload", "nocompute", "nosoftmax", "nopv", "nostore"):
    raise ValueError(f"unknown probe {options.probe!r}")
  if options.epilogue not in ("auto", "registers", "smem"):
    raise ValueError(f"unknown epilogue {options.epilogue!r}")
  if options.merge_columns < 0 or options.merge_columns % 128:
    raise ValueError(f"merge_columns must be 0 (default) or a multiple of 128 (the merge kernel's "
                     f"column blocks), got {options.merge_columns}")
  if options.pv not in ("auto", "value_wg", "split"):
    raise ValueError(f"unknown pv {options.pv!r}")
  if options.merge not in ("auto", "pairwise", "two_pass", "kernel"):
    raise ValueError(f"unknown merge {options.merge!r}")
  if options.live_splits not in (True, False, "auto"):
    raise ValueError(f"live_splits must be True, False or 'auto', got {options.live_splits!r}")
  if options.reduction_scratch and (options.reduction_scratch < REDUCTION_SCRATCH_BYTES
                                    or options.reduction_scratch % 1024):
    raise ValueError(f"Options.reduction_scratch must be 0 (as much as helps and fits) or a multiple of 1024 "
                     f"bytes of at least {REDUCTION_SCRATCH_BYTES}, got {options.reduction_scratch}")
  if partial_dtype not in ("auto", "float32", "bfloat16"):
    raise ValueError(f"partial_dtype must be 'auto', 'float32' or 'bfloat16', got {partial_dtype!r}")
  auto_partials = partial_dtype == "auto"
  if auto_partials:  # rows_n and an unstaged rows_m turn it back to float32
    bf16_queries = query_dtype is not None and jnp.dtype(query_dtype) == jnp.bfloat16
    partial_dtype = "bfloat16" if bf16_queries else "float32"
  if options.form not in ("auto", "rows_n", "rows_m"):
    raise ValueError(f"unknown form {options.form!r}")
  if len(options.regs) != 2 or any(r and not (24 <= r <= 256 and r % 8 == 0) for r in options.regs) or (
      sum(r or 232 for r in options.regs) + 40 > LAUNCH_REGISTERS * 3):
    raise ValueError(f"Options.regs={options.regs}: two register counts, each 0 (232) or a multiple of 8 "
                     f"in [24, 256], with the memory warpgroup's 40 at most {LAUNCH_REGISTERS * 3} in all "
                     f"(three warpgroups launched with {LAUNCH_REGISTERS} a thread)")
  rows = q_len * heads_per_group
  rows_m = None
  if options.form == "rows_m" or (
      options.form == "auto" and rows >= options.rows_m_min and _rows_m_applies(value_dim)
      and rows_per_tile in (None, ROWS_M)):
    rows_m = _plan_rows_m(rows=rows, q_len=q_len, num_work=num_work, key_dims=key_dims,
                          value_dim=value_dim, shared_value=shared_value, cache_len=cache_len,
                          num_splits=num_splits, partial_dtype=partial_dtype,
                          auto_partials=auto_partials, rows_per_tile=rows_per_tile,
                          options=options,
                          required=options.form == "rows_m" or options.epilogue == "smem")
    if options.form == "rows_m":
      return rows_m
  # Two value warpgroups when each half of Dv is still a whole number of 64-row wgmma tiles.
  value_wgs = 2 if value_dim % 128 == 0 else 1
  key_width = sum(key_dims)
  value_width = 0 if shared_value else value_dim
  swizzle = _swizzle_for(*key_dims, value_dim, BLOCK_KV)
  if swizzle is None:
    raise ValueError(f"feature widths {key_dims}, {value_dim} are not multiples of 16")
  num_words = -(-q_len // 32)
  # Registers of warpgroup 0 (128 threads): its O^T slice takes (Dv / value_wgs) * Rt / 128 and
  # S^T / P^T take 64 * Rt / 128 fp32 registers per thread; keep the sum under ~160.
  max_rows = (160 * 128) // (value_dim // value_wgs + BLOCK_KV)
  fits = []
  for rt in range(8, min(max_rows, 256) + 1, 8):  # a wgmma N dimension: a multiple of 8
    if rows_per_tile and rt != rows_per_tile:
      continue
    for stages in (4, 3, 2):
      if _smem_bytes(rt, key_width, value_width, num_words, stages) <= SMEM_BUDGET:
        fits.append((rt, stages))
        break
  if not fits:
    raise ValueError(
        f"tree attention: no row tile fits beside two {BLOCK_KV}-row KV stages of width "
        f"{key_width + value_width} (value width {value_dim}, rows_per_tile={rows_per_tile})")
  # Each row tile streams its request's KV into its SM once more and runs the per-tile chain of
  # warpgroup 0 over all of it (what bounds the kernel: the stream alone moved b1/32k/q17's
  # 113 MB in 17 us, the whole kernel 35), so the fewest row tiles win; among equals the
  # narrowest tile (least padding).
  rt, num_stages = min(fits, key=lambda o: (-(-rows // o[0]), o[0]))
  num_row_tiles = -(-rows // rt)
  # "auto": the 64-row form where it needs no more row tiles than this one (Kimi at 8 heads from
  # q_len 17, and 64 heads; not the demo model, whose 136-row tiles here would be 7 of 64).
  if rows_m is not None and rows_m.num_row_tiles <= num_row_tiles:
    return rows_m
  for applies, what in ((options.epilogue == "smem", "epilogue='smem'"),
                        (options.probe == "nostore", "probe 'nostore'")):
    if applies:  # never silently ignored: a variant that times the other form misleads
      raise ValueError(f"tree attention: {what} applies to form 'rows_m', and this call takes "
                       f"'rows_n' ({rows} rows per group); force form='rows_m' where it applies")
  if auto_partials:
    partial_dtype = "float32"  # bf16 partials from registers were slower (see Options.epilogue)
  if num_splits is None:
    num_splits = _choose_splits(-(-cache_len // BLOCK_KV),
                                _ctas_per_split(num_work, num_row_tiles))
  rows_stored = min(rt, _round_up(rows, 8)) if num_row_tiles == 1 else rt
  pv = options.pv
  if value_wgs == 1:
    pv = "split"  # one compute warpgroup does everything
  elif pv == "auto":
    pv = "value_wg" if value_dim * rt // 128 <= 192 else "split"
  elif pv == "value_wg" and value_dim * rt // 128 > 224:
    raise ValueError(f"pv='value_wg': O^T of {value_dim} x {rt} does not fit one warpgroup")
  # The lazy sum keeps one more [64, Rt] array live in warpgroup 0: only where registers allow
  # (with pv="split", Kimi's 48-row tile: 96 + 3 x 24 per thread; not the demo model's 136-row
  # tile).
  wg0_o_rows = value_dim // value_wgs if pv == "split" else 0
  lazy_sum = options.lazy_sum and (wg0_o_rows + 3 * BLOCK_KV) * rt // 128 <= 200
  options = dataclasses.replace(options, lazy_sum=lazy_sum, pv=pv, form="rows_n",
                                epilogue="registers",
                                live_splits=_live_splits_on(options, num_work, num_splits))
  spare = SMEM_BUDGET - _smem_bytes(rt, key_width, value_width, num_words, num_stages)
  if options.reduction_scratch > spare + REDUCTION_SCRATCH_BYTES:
    raise ValueError(f"Options.reduction_scratch={options.reduction_scratch} does not fit beside this plan's "
                     f"buffers (at most {spare + REDUCTION_SCRATCH_BYTES} bytes)")
  scratch = options.reduction_scratch or max(
      REDUCTION_SCRATCH_BYTES, min(rt * 128, (spare + REDUCTION_SCRATCH_BYTES) // 1024 * 1024))
  return Plan(rows_per_tile=rt, num_row_tiles=num_row_tiles, swizzle=swizzle,
              num_stages=num_stages, num_splits=num_splits,
              rows_stored=rows_stored, reduction_scratch=scratch, value_wgs=value_wgs,
              partial_dtype=partial_dtype, options=options)


def _plan_rows_m(*, rows, q_len, num_work, key_dims, value_dim, shared_value, cache_len,
                 num_splits, partial_dtype, auto_partials, rows_per_tile, options,
                 required) -> Plan | None:
  """The "rows_m" plan: 64-row tiles, two compute warpgroups, as many KV stages as fit (2-4).

  Returns None where it does not apply and ``required`` is false (then ``plan`` falls back).
  """
  def fail(why):
    if required:
      raise ValueError(f"tree attention, form='rows_m': {why}")
    return None

  if not _rows_m_applies(value_dim):
    return fail(f"value width {value_dim} is not a multiple of 128 up to 512")
  if rows_per_tile not in (None, ROWS_M):
    return fail(f"rows_per_tile must be {ROWS_M}, got {rows_per_tile}")
  if options.probe == "nosoftmax":
    return fail(f"probe {options.probe!r} applies to form='rows_n' only")
  # Warpgroup 0 owns half of O beside S and the softmax. A softmax-only warpgroup beside two
  # value warpgroups (4 warpgroups, pv="value_wg") does not compile: ptxas builds the whole kernel
  # for 65536 / 512 = 128 registers per thread, and a [64, 256] fp32 wgmma needs 154 (H200).
  if options.pv == "value_wg":
    return fail("pv='value_wg' (a fourth warpgroup) needs more than the 128 registers per "
                "thread that ptxas allows 512 threads")
  stageable = partial_dtype == "bfloat16" and key_dims[0] == value_dim
  epilogue = options.epilogue
  if epilogue == "auto":
    epilogue = "smem" if stageable else "registers"
  elif epilogue == "smem" and not stageable:
    if key_dims[0] != value_dim:
      why = f"its first part as wide as the values (got {key_dims[0]} and {value_dim})"
    else:
      why = (f"partial_dtype='bfloat16' (got {partial_dtype!r}"
             + (", what 'auto' gives for queries that are not bf16)" if auto_partials else ")"))
    return fail(f"epilogue='smem' stages O in the query tile: it needs {why}")
  if auto_partials and epilogue != "smem":
    partial_dtype = "float32"  # bf16 partials stored from registers were the slowest timed
  swizzle = _swizzle_for(*key_dims, value_dim, BLOCK_KV)
  if swizzle is None:
    return fail(f"feature widths {key_dims}, {value_dim} are not multiples of 16")
  key_width = sum(key_dims)
  value_width = 0 if shared_value else value_dim
  num_words = -(-q_len // 32)
  stages = [s for s in (4, 3, 2)
            if _smem_bytes_rows_m(key_width, value_width, num_words, s) <= SMEM_LIMIT]
  if not stages:
    return fail(f"two {BLOCK_KV}-row KV stages of width {key_width + value_width} and a "
                f"{ROWS_M}-row query tile do not fit {SMEM_LIMIT} bytes of shared memory")
  num_row_tiles = -(-rows // ROWS_M)
  if num_splits is None:
    num_splits = _choose_splits(-(-cache_len // BLOCK_KV),
                                _ctas_per_split(num_work, num_row_tiles))
  options = dataclasses.replace(options, form="rows_m", pv="split", lazy_sum=False,
                                epilogue=epilogue,
                                live_splits=_live_splits_on(options, num_work, num_splits))
  return Plan(rows_per_tile=ROWS_M, num_row_tiles=num_row_tiles, swizzle=swizzle,
              num_stages=stages[0], num_splits=num_splits, rows_stored=ROWS_M,
              reduction_scratch=0, value_wgs=2, partial_dtype=partial_dtype, options=options,
              form="rows_m")


def _live_splits_on(options: Options, num_work: int, num_splits: int) -> bool:
  """``Options.live_splits`` resolved: "auto" is on for more than one request-group and split
  (at batch 1 the H200 run found only the merge's read of the count added; with one split there
  is nothing to choose)."""
  if options.live_splits == "auto":
    return num_work > 1 and num_splits > 1
  return bool(options.live_splits)


START_UP_TILES = 2.0  # tiles' worth of per-CTA start-up (query tile, first KV tile, stores)


def _choose_splits(tiles: int, ctas_per_split: int) -> int:
  """KV splits per request: the count minimising (waves) x (tiles per CTA + start-up).

  One CTA fits an SM (shared memory), so ``ctas_per_split * splits`` CTAs run in waves of the SM
  count. Several waves of short splits beat one wave with idle SMs (batch 8 with long trees
  used to get one split per request); the 2% margin keeps the smaller count on near-ties, since
  every split adds a partial output to merge.
  """
  sms = num_sms()
  best, best_cost = 1, None
  for splits in range(1, max(1, min(tiles, 4 * sms)) + 1):
    waves = -(-ctas_per_split * splits // sms)
    cost = waves * (tiles / splits + START_UP_TILES)
    if best_cost is None or cost < best_cost * 0.98:
      best, best_cost = splits, cost
  return best


def _live_split_counts(live, *, cache_len: int, ctas_per_request_split: int, num_splits: int):
  """Each request's split count for its live columns (``Options.live_splits``): int32 [B].

  The batch is one grid, so the counts are chosen together, by the launched count's cost model
  (``_choose_splits``: waves x (tiles of a CTA + start-up)) applied to the whole batch: for a
  target of ``per`` tiles a split, request b takes ``clip(ceil(t_b / per), 1, num_splits)``
  splits; the waves count all requests' CTAs (``ctas_per_request_split`` each: groups x row
  tiles) and the busiest CTA sets the time. Every count vector is reached at some
  ``per = ceil(t_b / k)`` (k = 1 .. num_splits), so those are the candidates (or every ``per``
  up to the pool's tiles, where that is fewer: the work stays B x min(B x S, pool tiles));
  the cheapest, and among equally cheap ones the fewest splits in all (no near-tie margin: one of
  2% let the busiest CTA grow by 2% at h8 b32 with mixed lengths, which timed 3% slower than the
  launched count on the H200). One long request in a batch of short ones then keeps its splits
  (it sets the time) and the short ones take few. Last, each count is
  lowered to the splits that get columns: ``_split_range`` cuts ``live`` into tile-aligned
  ranges of ``ceil(live / c)`` rounded up to a tile, of which only ``ceil(live / range)`` are
  non-empty; with that count the ranges are the same.

  Args:
    live: int32 [B], each request's live columns (at most ``cache_len``; a request with none,
      e.g. an idle batch slot, gets a count of 1 and its split no tiles).
  """
  sms = num_sms()
  pool_tiles = -(-cache_len // BLOCK_KV)
  tiles = jnp.maximum((live + BLOCK_KV - 1) // BLOCK_KV, 1)  # [B]

  def split_counts(per):
    return jnp.clip((tiles + per - 1) // per, 1, num_splits)

  if live.shape[0] * num_splits <= pool_tiles:
    k = jnp.arange(1, num_splits + 1, dtype=jnp.int32)
    per = ((tiles[:, None] + k[None, :] - 1) // k[None, :]).reshape(-1)  # [B * S]
  else:
    per = jnp.arange(1, pool_tiles + 1, dtype=jnp.int32)
  counts = jax.vmap(split_counts)(per)  # [candidates, B]
  total = jnp.sum(counts, axis=1)
  waves = (ctas_per_request_split * total + sms - 1) // sms
  busiest = jnp.max((tiles[None, :] + counts - 1) // counts, axis=1)
  cost = waves.astype(jnp.float32) * (busiest.astype(jnp.float32) + START_UP_TILES)
  cheapest = cost == jnp.min(cost)
  chosen = split_counts(per[jnp.argmin(jnp.where(cheapest, total, jnp.iinfo(jnp.int32).max))])
  range_cols = (live + chosen - 1) // chosen
  range_cols = (range_cols + BLOCK_KV - 1) // BLOCK_KV * BLOCK_KV
  return jnp.where(live > 0, (live + range_cols - 1) // jnp.maximum(range_cols, 1), 1)


def _ctas_per_split(num_work: int, num_row_tiles: int) -> int:
  """CTAs of one split index over ``num_work`` row sets (requests x groups; the groups of one
  request for ``_live_split_counts``) and their row tiles: what the waves count in both the
  launched count (``plan``) and the per-request ones."""
  return num_work * num_row_tiles


def _split_range(meta_ref, bg, split, *, num_words: int, num_splits: int, cache_len: int,
                 live_splits: bool):
  """This CTA's KV columns: (pool slot, window start, end ``hi``, tile count, first tile that
  needs the window masks, ``tile_start(i)`` -> (nominal first column, clamped load start),
  ``active``: None, or with ``live_splits`` whether the split is one of the request's own count;
  an inactive split gets no tiles)."""
  bk = BLOCK_KV
  pool_slot = meta_ref[bg, 0, 1 + num_words, 0]
  window_start = meta_ref[bg, 0, 1 + num_words, 1]
  live = meta_ref[bg, 0, 1 + num_words, 2]
  active = None
  if live_splits:  # the request's count (``_live_split_counts``), as the merge reads it
    num_splits = jnp.clip(meta_ref[bg, 0, 1 + num_words, 3], 1, num_splits)
    active = split < num_splits
  # Equal tile-aligned ranges of this request's live columns, one per split.
  per_split = lax.div(lax.div(live + num_splits - 1, num_splits) + bk - 1, bk) * bk
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, live)
  num_tiles = jnp.maximum(lax.div(hi - lo + bk - 1, bk), 0)
  # First tile that reaches the window or the split's end: the tiles before it lie whole inside
  # [lo, hi) and the committed prefix (nothing clamped), so only the per-row prefix cut masks them
  # (it hides the prefix from padded rows); later tiles check the range and the packed bits.
  # Tile i is such a tile iff lo + (i + 1) * bk > min(window_start, hi).
  before = jnp.minimum(window_start, hi) - lo - bk
  first_window_tile = jnp.clip(jnp.where(before < 0, 0, lax.div(before, bk) + 1), 0, num_tiles)

  def tile_start(i):
    """Nominal first column of tile i, and where its load starts (clamped inside the pool)."""
    nominal = lo + i * bk
    return nominal, jnp.minimum(nominal, cache_len - bk)

  return pool_slot, window_start, hi, num_tiles, first_window_tile, tile_start, active


class _Refs(NamedTuple):
  """Both kernels' refs after the metadata, by name (``_split_refs``)."""
  q_refs: tuple
  key_refs: tuple
  value_ref: object
  o_ref: object
  lse_ref: object
  key_smem: tuple
  value_smem: object
  q_smem: object
  meta_smem: object
  p_smem: object
  exchange: object
  loaded: object
  consumed: object
  p_ready: object
  p_free: object
  q_barrier: object
  done: object


class _Cta(NamedTuple):
  """One CTA's grid coordinates and KV range (``_cta``)."""
  bg: jax.Array  # request x group
  split: jax.Array
  row_tile: jax.Array
  wg: jax.Array  # warpgroup
  group: jax.Array  # KV group of ``bg``
  pool_slot: jax.Array
  window_start: jax.Array
  hi: jax.Array  # end of this split's live columns
  num_tiles: jax.Array
  first_window_tile: jax.Array
  tile_start: object  # i -> (nominal first column, clamped load start), ``_split_range``
  active: jax.Array | None  # Options.live_splits: a split of the request's own count

  def when(self, condition):
    """``pl.when(condition)``, and only in an active split (``Options.live_splits``): the CTA of
    an inactive one runs no warpgroup's body, so it loads, stores and waits for nothing."""
    return pl.when(condition if self.active is None else condition & self.active)


def _cta(meta_ref, *, plan: Plan, num_groups: int, num_words: int, cache_len: int) -> _Cta:
  bg = lax.axis_index("bg")
  split = lax.axis_index("split")
  row_tile = lax.axis_index("rt")
  wg = lax.axis_index("wg")
  return _Cta(bg, split, row_tile, wg, lax.rem(bg, num_groups), *_split_range(
      meta_ref, bg, split, num_words=num_words, num_splits=plan.num_splits, cache_len=cache_len,
      live_splits=plan.live_splits))


def _window_visibility(col, window_start, num_words: int, row_vector, shape):
  """Packed visibility bits of the window columns (col - window_start in [0, 32 W)): a bool
  array of ``shape``; ``row_vector(r)`` gives metadata row r broadcast to it."""
  rel = col - window_start
  seen = jnp.zeros(shape, jnp.bool_)
  for word in range(num_words):
    shift = rel - 32 * word
    inside = (shift >= 0) & (shift < 32)
    bit = lax.shift_right_logical(row_vector(1 + word), jnp.clip(shift, 0, 31)) & 1
    seen = seen | (inside & (bit != 0))
  return seen


def _stream_kv(*, plan: Plan, refs: _Refs, meta_ref, cta: _Cta, num_words: int,
               shared_value: bool):
  """The memory warpgroup: the query tile and metadata, then KV tiles into the stage ring."""
  plgpu.set_max_registers(40, action="decrease")
  q_refs, q_smem, meta_smem, q_barrier = refs.q_refs, refs.q_smem, refs.meta_smem, refs.q_barrier
  loaded, consumed = refs.loaded, refs.consumed
  bg, row_tile, group, pool_slot = cta.bg, cta.row_tile, cta.group, cta.pool_slot
  num_tiles, tile_start = cta.num_tiles, cta.tile_start
  sources = list(refs.key_refs) + ([] if shared_value else [refs.value_ref])
  destinations = list(refs.key_smem) + ([] if shared_value else [refs.value_smem])
  rt_rows, bk, num_stages = plan.rows_per_tile, BLOCK_KV, plan.num_stages
  row0 = row_tile * rt_rows
  for part in range(len(q_refs)):
    plgpu.copy_gmem_to_smem(q_refs[part].at[bg, pl.ds(row0, rt_rows)], q_smem[part], q_barrier)
  plgpu.copy_gmem_to_smem(meta_ref.at[bg, row_tile, pl.ds(0, 1 + num_words)], meta_smem,
                          q_barrier)

  def copy(i, stage):
    _, start = tile_start(i)
    for src, dst in zip(sources, destinations):
      plgpu.copy_gmem_to_smem(src.at[pool_slot, pl.ds(start, bk), group], dst.at[stage],
                              loaded.at[stage])

  def load(i, _):
    stage = lax.rem(i, num_stages)

    @pl.when(i >= num_stages)
    def _():
      plgpu.barrier_wait(consumed.at[stage])

    if plan.options.probe == "noload":
      pl.when(i < num_stages)(lambda: copy(i, stage))

      @pl.when(i >= num_stages)
      def _():
        for _ in sources:
          plgpu.barrier_arrive(loaded.at[stage])
    else:
      copy(i, stage)

  lax.fori_loop(0, num_tiles, load, None)

  # Observe every completion of the consumed barriers before the kernel ends.
  def drain(i, _):
    plgpu.barrier_wait(consumed.at[lax.rem(i, num_stages)])

  lax.fori_loop(jnp.maximum(num_tiles - num_stages, 0), num_tiles, drain, None)


def _tile_visibility(col, prefix_cut, window=None):
  """Which (row, column) pairs of a KV tile are attended: columns below the row's prefix cut, and,
  on the tiles that reach the tree window (``window`` = (first window column, live end,
  visible_window(col)); None elsewhere), window columns whose packed visibility bit is set."""
  in_prefix = col < prefix_cut
  if window is None:
    return in_prefix
  nominal, hi, visible_window = window
  return (col >= nominal) & (col < hi) & (in_prefix | visible_window(col))


def _online_softmax_tile(s, visible, m_run, scale, kv_axis: int):
  """One KV tile of the base-2 online softmax: (new row max, rescale of the earlier tiles, P).

  ``s``: scores with the KV positions on ``kv_axis`` (0 in "rows_n"'s transposed tiles, 1 in
  "rows_m"'s); ``m_run``: the running row max.
  """
  s = jnp.where(visible, s * (scale * LOG2E), -jnp.inf)
  m_new = jnp.maximum(m_run, s.max(axis=kv_axis))
  # Rows that have seen no column yet keep m = -inf; exponentiate against 0 so no inf - inf.
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m_run - m_safe)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [1 - kv_axis]))
  return m_new, alpha, p


def _split_refs(refs, num_key_parts: int, shared_value: bool) -> _Refs:
  """Both kernels' refs after the metadata, by name: q parts, key pools, the value pool (key part
  0 when shared), the two outputs, then the scratch (the value stage is key part 0's when shared)."""
  n = num_key_parts
  q_refs, key_refs, rest = refs[:n], refs[n:2 * n], refs[2 * n:]
  if shared_value:
    value_ref = key_refs[0]
  else:
    value_ref, rest = rest[0], rest[1:]
  o_ref, lse_ref = rest[0], rest[1]
  (key_smem, value_smem, q_smem, meta_smem, p_smem, exchange, loaded, consumed, p_ready, p_free,
   q_barrier, done) = rest[2:]
  if shared_value:
    value_smem = key_smem[0]
  return _Refs(q_refs, key_refs, value_ref, o_ref, lse_ref, key_smem, value_smem, q_smem, meta_smem,
               p_smem, exchange, loaded, consumed, p_ready, p_free, q_barrier, done)


def _kernel(meta_ref, *refs, plan: Plan, num_key_parts: int, shared_value: bool,
            num_groups: int, num_words: int, cache_len: int, scale: float, interpreted: bool):
  """One CTA: request-group ``bg``, KV split ``split``, row tile ``rt``.

  Warpgroups 0 .. value_wgs - 1 compute, warpgroup ``value_wgs`` streams KV tiles.
  Refs (GMEM): meta_ref int32[BG, n_rt, 2 + W, Rt] (per row: prefix cut, packed window words; row
  1 + W starts with the request's pool slot, window start and live length); q parts
  [BG, rows, Dk_i] (a tile reaching past the last row reads zeros: TMA fills out-of-bounds boxes);
  key pools [S, T, G, Dk_i]; value pool [S, T, G, Dv] unless shared with key part 0; outputs
  o_part [BG, splits, n_rt, rows_stored, Dv] and lse_part [BG, splits, n_rt, Rt]; then scratch.
  """
  named = _split_refs(refs, num_key_parts, shared_value)
  (_, _, _, o_ref, lse_ref, key_smem, value_smem, q_smem, meta_smem, p_smem, exchange, loaded,
   consumed, p_ready, p_free, q_barrier, done) = named  # the GMEM inputs: the memory warpgroup's

  rt_rows = plan.rows_per_tile
  bk = BLOCK_KV
  num_stages = plan.num_stages
  vw = plan.value_wgs
  opts = plan.options
  # Warpgroup w multiplies V^T P^T for Dv rows [w - w0, w - w0 + 1) * dv_slice (w0 = 1 when
  # warpgroup 1 does all of it).
  pv_split = opts.pv == "split"
  dv_slice = value_smem.shape[-1] // (vw if pv_split else 1)
  pv_first = 0 if pv_split else 1
  regs0, regs1 = (r or 232 for r in opts.regs)

  cta = _cta(meta_ref, plan=plan, num_groups=num_groups, num_words=num_words, cache_len=cache_len)
  bg, split, row_tile, wg = cta.bg, cta.split, cta.row_tile, cta.wg
  window_start, hi, num_tiles, first_window_tile, tile_start = (
      cta.window_start, cta.hi, cta.num_tiles, cta.first_window_tile, cta.tile_start)
  reduce0 = plgpu.Layout.WGMMA.reduce(0)

  def add_values(acc, stage, buf, which: int):
    """``acc [Dv / vw, Rt] += V^T[which slice] P^T[buf]`` (V^T read from the KV stage)."""
    v_t = value_smem.at[stage, :, pl.ds(which * dv_slice, dv_slice)].transpose((1, 0))
    p_t = p_smem.at[buf].transpose((1, 0))  # [64 kv, Rt], kv contiguous (K-major B operand)
    return _accumulate(lambda acc_ref: plgpu.wgmma(acc_ref, v_t, p_t), acc, interpreted)

  def store_output(acc, which: int, inv_l):
    out = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [1])).astype(o_ref.dtype)
    if plan.rows_stored < rt_rows:
      out = out[:, :plan.rows_stored]
    # O^T goes out as O ([rows, Dv], Dv contiguous) through a transposed view of the output:
    # the transposed WGMMA layout holds pairs of consecutive Dv entries per thread, which is what
    # a store into the view wants (so the merge needs no transpose kernel).
    if not interpreted:
      out = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
    o_ref.at[bg, split, row_tile, :, pl.ds(which * dv_slice, dv_slice)].transpose((1, 0))[...] = out

  def zero_acc():
    return plgpu.layout_cast(jnp.zeros((dv_slice, rt_rows), jnp.float32), plgpu.Layout.WGMMA)

  @cta.when(wg == vw)
  def _memory_wg():
    _stream_kv(plan=plan, refs=named, meta_ref=meta_ref, cta=cta, num_words=num_words,
               shared_value=shared_value)

  @cta.when(wg == 0)
  def _softmax_wg():
    plgpu.set_max_registers(regs0, action="increase")
    plgpu.barrier_wait(q_barrier)

    def row_vector(r):
      """Metadata row r as [64, Rt], constant along the KV axis."""
      return lax.broadcast_in_dim(plgpu.load(meta_smem.at[r], layout=reduce0), (bk, rt_rows), [1])

    prefix_cut = row_vector(0)
    kv_iota = plgpu.broadcasted_iota(jnp.int32, (bk, rt_rows), 0, layout=plgpu.Layout.WGMMA)

    def visible_window(col):
      return _window_visibility(col, window_start, num_words, row_vector, (bk, rt_rows))

    def step(i, carry, window: bool):
      acc, m_run, l_run = carry
      stage = lax.rem(i, num_stages)
      buf = lax.rem(i, 2)
      nominal, start = tile_start(i)
      plgpu.barrier_wait(loaded.at[stage])
      if opts.probe == "nocompute":
        plgpu.barrier_arrive(consumed.at[stage])
        return carry

      def scores(acc_ref):
        for part in range(num_key_parts):
          plgpu.wgmma(acc_ref, key_smem[part].at[stage], q_smem[part].transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((bk, rt_rows), jnp.float32))
      if opts.probe == "nosoftmax":
        ones = plgpu.layout_cast(jnp.ones((rt_rows,), jnp.float32), reduce0)
        return finish(i, stage, buf, acc, s, m_run, ones, m_run, l_run)
      vis = _tile_visibility(kv_iota + start, prefix_cut, (nominal, hi, visible_window) if window else None)
      m_new, alpha, p = _online_softmax_tile(s, vis, m_run, scale, kv_axis=0)
      if opts.lazy_sum:  # l_run is [bk, Rt]: summed over the KV axis after the loop
        l_run = l_run * lax.broadcast_in_dim(alpha, s.shape, [1]) + p
      else:
        l_run = l_run * alpha + p.sum(axis=0)
      return finish(i, stage, buf, acc, p, m_run, alpha, m_new, l_run)

    def finish(i, stage, buf, acc, p, m_run, alpha, m_new, l_run):
      """Hands P and the rescale factors over, then adds this warpgroup's half of V^T P^T."""
      if vw == 2:
        # Buffer ``buf`` was last read by warpgroup 1 two tiles ago.
        @pl.when(i >= 2)
        def _():
          plgpu.barrier_wait(p_free.at[buf])

        exchange.at[buf][...] = alpha
      p_smem.at[buf].transpose((1, 0))[...] = p.astype(p_smem.dtype)
      plgpu.commit_smem()
      if vw == 2:
        plgpu.barrier_arrive(p_ready.at[buf])
      if pv_split:
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
        if opts.probe != "nopv":
          acc = add_values(acc, stage, buf, 0)
      plgpu.barrier_arrive(consumed.at[stage])
      return acc, m_new, l_run

    m_run = plgpu.layout_cast(jnp.full((rt_rows,), -jnp.inf, jnp.float32), reduce0)
    if opts.lazy_sum:
      l_run = plgpu.layout_cast(jnp.zeros((bk, rt_rows), jnp.float32), plgpu.Layout.WGMMA)
    else:
      l_run = plgpu.layout_cast(jnp.zeros((rt_rows,), jnp.float32), reduce0)
    acc0 = zero_acc() if pv_split else None  # no O^T rows in warpgroup 0
    carry = lax.fori_loop(0, first_window_tile, functools.partial(step, window=False),
                          (acc0, m_run, l_run))
    acc, m_run, l_run = lax.fori_loop(first_window_tile, num_tiles,
                                      functools.partial(step, window=True), carry)
    if opts.lazy_sum:
      l_run = l_run.sum(axis=0)
    empty = l_run == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l_run)
    if vw == 2:
      exchange.at[2][...] = inv_l
      plgpu.commit_smem()
      plgpu.barrier_arrive(done)
    if pv_split:
      store_output(acc, 0, inv_l)
    lse_ref.at[bg, split, row_tile][...] = jnp.where(
        empty, -jnp.inf, m_run + jnp.log2(jnp.where(empty, 1.0, l_run)))

  if vw == 2:
    @cta.when(wg == 1)
    def _values_wg():
      plgpu.set_max_registers(regs1, action="increase")

      def step(i, acc):
        stage = lax.rem(i, num_stages)
        buf = lax.rem(i, 2)
        plgpu.barrier_wait(loaded.at[stage])
        if opts.probe == "nocompute":
          plgpu.barrier_arrive(consumed.at[stage])
          return acc
        plgpu.barrier_wait(p_ready.at[buf])
        alpha = plgpu.load(exchange.at[buf], layout=reduce0)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
        if opts.probe != "nopv":
          acc = add_values(acc, stage, buf, 1 - pv_first)
        # Only tile i + 2's hand-off waits for this buffer: one arrival per wait (the interpreter
        # rejects a barrier phase nobody observes).
        pl.when(i + 2 < num_tiles)(lambda: plgpu.barrier_arrive(p_free.at[buf]))
        plgpu.barrier_arrive(consumed.at[stage])
        return acc

      acc = lax.fori_loop(0, num_tiles, step, zero_acc())
      plgpu.barrier_wait(done)
      store_output(acc, 1 - pv_first, plgpu.load(exchange.at[2], layout=reduce0))


class _RowsMTools(NamedTuple):
  """The "rows_m" kernel's steps (``_rows_m_tools``), which ``_kernel_rows_m`` chains (a second
  schedule, the seesaw, shared them until it was removed)."""
  scores: object  # stage -> S = Q K^T of that KV stage, fp32 [64, 64]
  init_carry: object  # () -> (zero O half, row max -inf, row sum 0)
  finish_wg0: object  # (acc, m_run, l_run) -> 1 / l to warpgroup 1, O[:, :Dv/2] and the lse out
  finish_wg1: object  # acc -> O[:, Dv/2:] out, once warpgroup 0 has sent 1 / l
  add_values: object  # (acc, p, stage, half) -> acc + P V[:, half]
  rescale: object  # (acc, alpha [64]) -> acc * alpha per row
  zero_acc: object  # () -> a zero [64, Dv / 2] fp32 accumulator
  row_vector: object  # r -> metadata row r as [64, 64], constant along the KV axis
  visible_window: object  # col -> the window's packed visibility bits as [64, 64] bools
  per_row: object  # the layout of a [64] per-row vector of a WGMMA array


def _rows_m_tools(named: _Refs, plan: Plan, cta: _Cta, interpreted: bool, num_words: int) -> _RowsMTools:
  o_ref, value_smem, q_smem, meta_smem = named.o_ref, named.value_smem, named.q_smem, named.meta_smem
  rows, bk = plan.rows_per_tile, BLOCK_KV
  opts = plan.options
  dv_half = value_smem.shape[-1] // 2
  staged = opts.epilogue == "smem"
  done = named.done
  if staged:  # "done", then warpgroup 1's "my half of O is in the query tile"
    done, staged_half = done.at[0], done.at[1]
  per_row = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector, one entry per row of a WGMMA array

  def add_values(acc, p, stage, half: int):
    """``acc [64, Dv / 2] += P V[:, half]`` (P: bf16 registers or the shared buffer)."""
    v = value_smem.at[stage, :, pl.ds(half * dv_half, dv_half)]
    return _accumulate(lambda acc_ref: plgpu.wgmma(acc_ref, p, v), acc, interpreted)

  def rescale(acc, alpha):
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

  def store_output(acc, half: int, inv_l):
    out = rescale(acc, inv_l).astype(o_ref.dtype)
    if opts.probe == "nostore":
      return
    columns = pl.ds(half * dv_half, dv_half)
    bg, split, row_tile = cta.bg, cta.split, cta.row_tile
    if not staged:
      o_ref.at[bg, split, row_tile, :, columns][...] = out
      return
    # Staged in the query tile (same bf16 width as O): every read of it for S is over by now
    # (warpgroup 0's; warpgroup 1 waits for "done" before its half).
    # A TMA store needs a contiguous tile, not one half's columns: warpgroup 0 stores both.
    q_smem[0].at[:, columns][...] = out
    plgpu.commit_smem()
    if half == 1:
      plgpu.barrier_arrive(staged_half)
      return
    plgpu.barrier_wait(staged_half)
    plgpu.copy_smem_to_gmem(q_smem[0], o_ref.at[bg, split, row_tile])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the CTA's shared memory must outlive the read

  def zero_acc():
    return plgpu.layout_cast(jnp.zeros((rows, dv_half), jnp.float32), plgpu.Layout.WGMMA)

  def row_vector(r):
    return lax.broadcast_in_dim(plgpu.load(meta_smem.at[r], layout=per_row), (rows, bk), [0])

  def visible_window(col):
    return _window_visibility(col, cta.window_start, num_words, row_vector, (rows, bk))

  exchange, lse_ref = named.exchange, named.lse_ref
  q_smem, key_smem = named.q_smem, named.key_smem

  def scores(stage):
    def product(acc_ref):
      for part in range(len(key_smem)):
        plgpu.wgmma(acc_ref, q_smem[part], key_smem[part].at[stage].transpose((1, 0)))
      return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((rows, bk), jnp.float32))

  def init_carry():
    m_run = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), per_row)
    l_run = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), per_row)
    return zero_acc(), m_run, l_run

  def finish_wg0(acc, m_run, l_run):
    empty = l_run == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l_run)
    exchange.at[1][...] = inv_l
    plgpu.commit_smem()
    plgpu.barrier_arrive(done)
    store_output(acc, 0, inv_l)
    lse_ref.at[cta.bg, cta.split, cta.row_tile][...] = jnp.where(
        empty, -jnp.inf, m_run + jnp.log2(jnp.where(empty, 1.0, l_run)))

  def finish_wg1(acc):
    plgpu.barrier_wait(done)
    store_output(acc, 1, plgpu.load(exchange.at[1], layout=per_row))

  return _RowsMTools(scores, init_carry, finish_wg0, finish_wg1, add_values, rescale, zero_acc, row_vector,
                     visible_window, per_row)


def _kernel_rows_m(meta_ref, *refs, plan: Plan, num_key_parts: int, shared_value: bool,
                   num_groups: int, num_words: int, cache_len: int, scale: float,
                   interpreted: bool):
  """One CTA of the "rows_m" form: request-group ``bg``, KV split ``split``, 64-row tile ``rt``.

  Warpgroup 0 computes ``S = Q K^T`` ([64 rows, 64 kv], both operands in shared memory) and the
  online softmax (row-wise: each row's 64 scores lie in one warp quad, so the reductions are
  shuffles, no shared memory), hands ``P`` (bf16) and the rescale factors to warpgroup 1 through
  shared memory, and accumulates ``O[:, :Dv/2] += P V[:, :Dv/2]`` with P from registers;
  warpgroup 1 accumulates ``O[:, Dv/2:]`` with P from shared memory; warpgroup 2 streams the
  tiles (``_stream_kv``). Refs as in ``_kernel`` (row tile 64, rows_stored 64).
  """
  named = _split_refs(refs, num_key_parts, shared_value)
  p_smem, exchange = named.p_smem, named.exchange
  loaded, consumed, p_ready, p_free, q_barrier = (
      named.loaded, named.consumed, named.p_ready, named.p_free, named.q_barrier)

  rows, bk = plan.rows_per_tile, BLOCK_KV
  num_stages = plan.num_stages
  opts = plan.options
  regs0, regs1 = (r or 232 for r in opts.regs)

  cta = _cta(meta_ref, plan=plan, num_groups=num_groups, num_words=num_words, cache_len=cache_len)
  wg, hi, num_tiles, first_window_tile, tile_start = (
      cta.wg, cta.hi, cta.num_tiles, cta.first_window_tile, cta.tile_start)
  tools = _rows_m_tools(named, plan, cta, interpreted, num_words)
  add_values, rescale, zero_acc, per_row = tools.add_values, tools.rescale, tools.zero_acc, tools.per_row

  @cta.when(wg == 2)
  def _memory_wg():
    _stream_kv(plan=plan, refs=named, meta_ref=meta_ref, cta=cta, num_words=num_words,
               shared_value=shared_value)

  @cta.when(wg == 0)
  def _softmax_wg():
    plgpu.set_max_registers(regs0, action="increase")
    plgpu.barrier_wait(q_barrier)
    prefix_cut = tools.row_vector(0)
    kv_iota = plgpu.broadcasted_iota(jnp.int32, (rows, bk), 1, layout=plgpu.Layout.WGMMA)

    def step(i, carry, window: bool):
      acc, m_run, l_run = carry
      stage = lax.rem(i, num_stages)
      nominal, start = tile_start(i)
      plgpu.barrier_wait(loaded.at[stage])
      if opts.probe == "nocompute":
        plgpu.barrier_arrive(consumed.at[stage])
        return carry

      s = tools.scores(stage)
      vis = _tile_visibility(kv_iota + start, prefix_cut,
                             (nominal, hi, tools.visible_window) if window else None)
      m_new, alpha, p = _online_softmax_tile(s, vis, m_run, scale, kv_axis=1)
      l_run = l_run * alpha + p.sum(axis=1)
      p16 = p.astype(jnp.bfloat16)

      # The one P buffer was last read by warpgroup 1 for tile i - 1.
      @pl.when(i >= 1)
      def _():
        plgpu.barrier_wait(p_free)

      exchange.at[0][...] = alpha
      p_smem[...] = p16
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      acc = rescale(acc, alpha)
      if opts.probe != "nopv":
        # The GPU interpreter of jax 0.11 takes a wgmma's A from shared memory only: there warpgroup
        # 0 reads the P it just stored (the same bf16 values).
        acc = add_values(acc, p_smem if interpreted else p16, stage, 0)
      plgpu.barrier_arrive(consumed.at[stage])
      return acc, m_new, l_run

    carry = lax.fori_loop(0, first_window_tile, functools.partial(step, window=False),
                          tools.init_carry())
    tools.finish_wg0(*lax.fori_loop(first_window_tile, num_tiles,
                                    functools.partial(step, window=True), carry))

  @cta.when(wg == 1)
  def _values_wg():
    plgpu.set_max_registers(regs1, action="increase")
    half = 1

    def step(i, acc):
      stage = lax.rem(i, num_stages)
      plgpu.barrier_wait(loaded.at[stage])
      if opts.probe == "nocompute":
        plgpu.barrier_arrive(consumed.at[stage])
        return acc
      plgpu.barrier_wait(p_ready)
      acc = rescale(acc, plgpu.load(exchange.at[0], layout=per_row))
      if opts.probe != "nopv":
        acc = add_values(acc, p_smem, stage, half)
      # Warpgroup 0 waits for this before storing the next tile's P (none after the last).
      pl.when(i + 1 < num_tiles)(lambda: plgpu.barrier_arrive(p_free))
      plgpu.barrier_arrive(consumed.at[stage])
      return acc

    tools.finish_wg1(lax.fori_loop(0, num_tiles, step, zero_acc()))


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
            partial_dtype="auto", rows_per_tile=None, options=None, window_meta=None,
            name="tree attention", call_dims=(), query_dtype=None):
  """Runs the kernel on folded operands and merges the partials.

  Args:
    q_parts: bf16 [BG, rows, Dk_i] queries, rows = Q * heads_per_group (row = q * hpg + h).
    key_pools: bf16 [S, T, G, Dk_i]; value_pool: bf16 [S, T, G, Dv], or None when the values are
      key part 0 (absorbed MLA).
    slots, prefix_len: int32[B]; visibility: bool[B, Q, Q]; valid: bool[B, Q].
    window_meta: a ``WindowMeta`` built for this call's shapes, or None to build it here.
    call_dims: ((name, value), ...) of the caller's own widths and pool length, checked against
      ``window_meta`` beside what the metadata itself depends on (``_meta_layout``).
    query_dtype: the caller's query dtype before the bf16 conversion (``partial_dtype="auto"``).
  Returns:
    float32 [BG, rows, Dv].
  """
  bg_count, rows = q_parts[0].shape[:2]
  cache_len = key_pools[0].shape[1]
  key_dims = [q.shape[-1] for q in q_parts]
  value_dim = (key_pools[0] if value_pool is None else value_pool).shape[-1]
  pl_ = plan(q_len=q_len, heads_per_group=heads_per_group, num_work=bg_count, key_dims=key_dims,
             value_dim=value_dim, shared_value=value_pool is None, cache_len=cache_len,
             num_splits=num_splits, partial_dtype=partial_dtype, rows_per_tile=rows_per_tile,
             options=options, query_dtype=query_dtype)
  rt_rows, n_rt = pl_.rows_per_tile, pl_.num_row_tiles
  # A TMA box may overhang the array's end (zero fill) but not exceed its size, and the tiled
  # copy wants whole 8-row tiles: pad only then (never for Kimi's 8 heads once Q * 8 >= Rt).
  rows_in = max(rt_rows, _round_up(rows, 8))
  if rows_in != rows:
    q_parts = [jnp.pad(q, ((0, 0), (0, rows_in - rows), (0, 0))) for q in q_parts]
  layout = _meta_layout(batch=valid.shape[0], q_len=q_len, heads_per_group=heads_per_group,
                        num_groups=num_groups, cache_len=cache_len, pl_=pl_, call_dims=call_dims)
  if window_meta is None:
    meta = _window_meta(slots, prefix_len, visibility, valid, q_len=q_len, cache_len=cache_len,
                        heads_per_group=heads_per_group, num_groups=num_groups, pl_=pl_)
    live_counts = _split_counts(meta, pl_)
    # As opaque to the merge as a prepared ``window_meta`` is: fused into the XLA merge, the
    # counts let XLA build other merge kernels, which on the H200 added differently (h8 b8 4k q9).
    meta, live_counts = lax.optimization_barrier((meta, live_counts))
  else:
    meta, live_counts = _checked_meta(name, window_meta, layout)
  num_words = meta.shape[2] - 2

  transforms = _transforms(pl_.swizzle)
  stages = pl_.num_stages
  shared_value = value_pool is None
  rows_m = pl_.form == "rows_m"
  scratch = [
      tuple(plgpu.SMEM((stages, BLOCK_KV, d), jnp.bfloat16, transforms=transforms)
            for d in key_dims),
      None if shared_value else plgpu.SMEM((stages, BLOCK_KV, value_dim), jnp.bfloat16,
                                           transforms=transforms),
      tuple(plgpu.SMEM((rt_rows, d), jnp.bfloat16, transforms=transforms) for d in key_dims),
      plgpu.SMEM((1 + num_words, rt_rows), jnp.int32),
      # P: two [Rt, 64] buffers; "rows_m": one [64 rows, 64 kv] (no room for a second).
      plgpu.SMEM((rt_rows, BLOCK_KV) if rows_m else (2, rt_rows, BLOCK_KV), jnp.bfloat16,
                 transforms=transforms),
      # Rescale factors (2 buffers; "rows_m": 1) and the final 1 / l.
      plgpu.SMEM((2 if rows_m else 3, rt_rows), jnp.float32),
      plgpu.Barrier(num_arrivals=len(key_dims) + (0 if shared_value else 1),
                    num_barriers=stages),  # loaded
      plgpu.Barrier(num_arrivals=pl_.value_wgs, num_barriers=stages),  # consumed
      plgpu.Barrier(num_arrivals=1, num_barriers=1 if rows_m else 2),  # p_ready
      plgpu.Barrier(num_arrivals=1, num_barriers=1 if rows_m else 2),  # p_free
      plgpu.Barrier(num_arrivals=len(key_dims) + 1),  # q_barrier
      # done (with Options.epilogue="smem" a second: warpgroup 1's half of O staged)
      plgpu.Barrier(num_arrivals=1, num_barriers=2 if rows_m and pl_.options.epilogue == "smem" else 1),
  ]
  out_type = (
      jax.ShapeDtypeStruct((bg_count, pl_.num_splits, n_rt, pl_.rows_stored, value_dim),
                           jnp.dtype(pl_.partial_dtype)),
      jax.ShapeDtypeStruct((bg_count, pl_.num_splits, n_rt, rt_rows), jnp.float32),
  )
  body = functools.partial(
      _kernel_rows_m if rows_m else _kernel, plan=pl_, num_key_parts=len(key_dims), shared_value=shared_value,
      num_groups=num_groups, num_words=num_words, cache_len=cache_len, scale=float(scale),
      interpreted=interpret is not None)

  def launched_body(*refs):
    pdl_prologue(pl_.options.pdl, interpret)
    body(*refs)

  kernel = plgpu.kernel(
      launched_body, out_type=out_type, scratch_types=scratch,
      grid=(bg_count, pl_.num_splits, n_rt), grid_names=("bg", "split", "rt"),
      kernel_name="tree_attention",  # named in profiles (CUPTI, ncu)
      num_threads=pl_.value_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           reduction_scratch_bytes=pl_.reduction_scratch),
      interpret=interpret)
  operands = [meta, *q_parts, *key_pools] + ([] if shared_value else [value_pool])
  o_part, lse_part = kernel(*operands)
  return _merge(o_part, lse_part, pl_, rows, interpret=interpret, live_counts=live_counts)


def _split_counts(meta, pl_: Plan):
  """int32 [BG]: each request-group's split count (``Options.live_splits``) as the kernel reads
  it from ``meta``, for the merge (the splits past it are never written); None without."""
  if not pl_.live_splits:
    return None
  return jnp.clip(meta[:, 0, meta.shape[2] - 1, 3], 1, pl_.num_splits)


def _window_meta(slots, prefix_len, visibility, valid, *, q_len, cache_len, heads_per_group,
                 num_groups, pl_: Plan):
  """The kernel's per-row-tile metadata, int32 [BG, n_rt, 2 + W, Rt] (one XLA fusion).

  Row 0: prefix cut per query row (``prefix_len`` for real rows, 0 for padded ones); rows 1..W:
  the packed window bits (``window_mask_bits``); row 1 + W: pool slot, window start and live
  columns ``min(prefix_len + Q, T)`` of the request, then with ``Options.live_splits`` its split
  count (``_live_split_counts``; the rest zero). Query row r of tile t is
  ``q = (t * Rt + r) // heads_per_group``; rows past ``Q * heads_per_group`` see nothing.
  """
  batch = valid.shape[0]
  n_rt, rows_per_tile = pl_.num_row_tiles, pl_.rows_per_tile
  words = window_mask_bits(visibility, valid)  # [B, Q, W]
  num_words = words.shape[-1]
  cut = jnp.where(valid, prefix_len[:, None], 0).astype(jnp.int32)  # [B, Q]
  per_q = jnp.concatenate([cut[:, None, :], jnp.swapaxes(words, 1, 2)], axis=1)  # [B, 1 + W, Q]
  rows = q_len * heads_per_group
  per_row = jnp.broadcast_to(per_q[..., None], per_q.shape + (heads_per_group,))
  per_row = per_row.reshape(batch, 1 + num_words, rows)
  per_row = jnp.pad(per_row, ((0, 0), (0, 0), (0, n_rt * rows_per_tile - rows)))
  per_row = per_row.reshape(batch, 1 + num_words, n_rt, rows_per_tile).transpose(0, 2, 1, 3)
  live = jnp.minimum(prefix_len + q_len, cache_len)
  per_request = [slots, prefix_len, live]
  if pl_.live_splits:
    per_request.append(_live_split_counts(
        live, cache_len=cache_len, ctas_per_request_split=_ctas_per_split(num_groups, n_rt),
        num_splits=pl_.num_splits))
  req = jnp.stack(per_request, axis=1).astype(jnp.int32)  # [B, 3 or 4]
  req = jnp.pad(req, ((0, 0), (0, rows_per_tile - req.shape[1])))
  req = jnp.broadcast_to(req[:, None, None, :], (batch, n_rt, 1, rows_per_tile))
  meta = jnp.concatenate([per_row, req], axis=2)  # [B, n_rt, 2 + W, Rt]
  return jnp.repeat(meta, num_groups, axis=0)  # [BG, ...] (bg = b * G + g)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["meta", "split_counts"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class WindowMeta:
  """The kernel's per-step window metadata, built once and shared by every layer.

  What ``_window_meta`` derives from a step's ``slots``, ``prefix_len``, ``visibility`` and
  ``valid`` (the per-row prefix cuts, the packed window bits, and each request's slot, window
  start and live length) depends on the window and on static shapes, never on the layer. A model
  that runs many layers over one window builds it once with ``prepare_mla_window`` (or
  ``prepare_mha_window``) outside its layer loop and passes it to every call as
  ``window_meta=``; each call then runs only the kernel and the merge. A pytree: ``meta`` and
  ``split_counts`` are arrays (the second None without live splits), ``layout`` static (so it can
  be closed over or passed through ``jit`` and ``lax.scan``).

  The call checks ``layout`` against its own shapes and plan and raises ``ValueError`` naming
  each mismatch; it cannot check that the values came from the same window, which is the
  caller's promise (the window arguments of the call are then only shape-checked).
  """

  meta: jax.Array  # int32 [B * G, row tiles, 2 + W, rows per tile]
  layout: tuple  # ((name, value), ...): what the array was built for (see ``_meta_layout``)
  # Options.live_splits: int32 [B * G], the counts in ``meta`` as the merge reads them, taken out
  # here once per step so that no layer runs a fusion for them (``_split_counts``); else None.
  split_counts: jax.Array | None = None


def _meta_layout(*, batch, q_len, heads_per_group, num_groups, cache_len, pl_: Plan,
                 call_dims=()) -> tuple:
  """What a window's metadata depends on besides the window's values (``cache_len`` is the
  pool's column count after the kernel's padding: the live length is clipped to it), then the
  call's own widths and unpadded pool length (``call_dims``: the array would often be the same
  for others, but a meta prepared for other shapes is a caller's mistake, so it raises)."""
  return (("batch", batch), ("q_len", q_len), ("heads_per_group", heads_per_group),
          ("num_groups", num_groups), ("padded cache_len", cache_len),
          ("rows_per_tile", pl_.rows_per_tile), ("row_tiles", pl_.num_row_tiles),
          ("live_splits", pl_.num_splits if pl_.live_splits else 0)) + tuple(call_dims)


def _checked_meta(name, window_meta, layout):
  """(meta, split counts or None) of ``window_meta`` after checking it was built for ``layout``."""
  if not isinstance(window_meta, WindowMeta):
    raise TypeError(f"{name}: window_meta must be a WindowMeta (from prepare_mla_window or "
                    f"prepare_mha_window), got {type(window_meta).__name__}")
  have, want = dict(window_meta.layout), dict(layout)
  diff = [f"{k} {have.get(k)} (prepared) != {v} (this call)" for k, v in want.items()
          if have.get(k) != v]
  if diff:
    raise ValueError(f"{name}: window_meta was prepared for other shapes: " + "; ".join(diff))
  meta = window_meta.meta
  num_words = -(-want["q_len"] // 32)
  shape = (want["batch"] * want["num_groups"], want["row_tiles"], 2 + num_words,
           want["rows_per_tile"])
  if tuple(meta.shape) != shape or meta.dtype != jnp.int32:
    raise ValueError(f"{name}: window_meta.meta must be int32{list(shape)} for its layout, got "
                     f"{meta.dtype}{list(meta.shape)}")
  counts = window_meta.split_counts
  if want["live_splits"] and (counts is None or tuple(counts.shape) != shape[:1]
                              or counts.dtype != jnp.int32):
    raise ValueError(f"{name}: window_meta.split_counts must be int32[{shape[0]}] with live splits "
                     f"(as prepare_mla_window / prepare_mha_window build it), got "
                     + ("None" if counts is None else f"{counts.dtype}{list(counts.shape)}"))
  if not want["live_splits"] and counts is not None:
    raise ValueError(f"{name}: window_meta.split_counts must be None without live splits")
  return meta, counts


def _prepare(name, slots, prefix_len, visibility, valid, *, heads_per_group, num_groups, key_dims,
             value_dim, shared_value, cache_len, num_splits, partial_dtype, rows_per_tile, options,
             call_dims):
  batch, q_len = valid.shape if valid.ndim == 2 else (None, None)
  if batch is None:
    raise ValueError(f"{name}: valid must be [B, Q], got shape {tuple(valid.shape)}")
  _check_window(name, slots, prefix_len, visibility, valid, batch, q_len)
  if cache_len < 1:
    raise ValueError(f"{name}: cache_len must be positive, got {cache_len}")
  _check_call(name, widths={}, scale=1.0, num_splits=num_splits, interpret=None)  # as the calls check it
  padded_len = padded_cache_len(cache_len)
  # The row tiles do not depend on the partial dtype; "auto" is planned as for bf16 queries so
  # that options which need bf16 partials (epilogue="smem") are accepted as the call accepts them.
  pl_ = plan(q_len=q_len, heads_per_group=heads_per_group, num_work=batch * num_groups,
             key_dims=key_dims, value_dim=value_dim, shared_value=shared_value,
             cache_len=padded_len, num_splits=num_splits, partial_dtype=partial_dtype,
             rows_per_tile=rows_per_tile, options=options, query_dtype=jnp.bfloat16)
  meta = _window_meta(slots.astype(jnp.int32), prefix_len.astype(jnp.int32), visibility, valid,
                      q_len=q_len, cache_len=padded_len, heads_per_group=heads_per_group,
                      num_groups=num_groups, pl_=pl_)
  return WindowMeta(meta=meta, layout=_meta_layout(
      batch=batch, q_len=q_len, heads_per_group=heads_per_group, num_groups=num_groups,
      cache_len=padded_len, pl_=pl_, call_dims=call_dims), split_counts=_split_counts(meta, pl_))


def offset_window_slots(window_meta: WindowMeta, offset) -> WindowMeta:
  """``window_meta`` for the same window with every request's pool slot moved by ``offset`` (an
  int32 scalar, traced or not): for a pool that stacks several layers' slots, each layer's at its
  own offset (``models.kimi``), so one step's metadata serves every layer. One small fusion."""
  if not isinstance(window_meta, WindowMeta):
    raise TypeError(f"offset_window_slots: window_meta must be a WindowMeta, got {type(window_meta).__name__}")
  meta = window_meta.meta  # [BG, row tiles, 2 + W, Rt]; the request row is the last, its slot first
  meta = meta.at[:, :, -1, 0].add(jnp.asarray(offset, jnp.int32))
  return dataclasses.replace(window_meta, meta=meta)


def _mla_dims(latent_dim, rope_dim, cache_len):
  return (("latent_dim", latent_dim), ("rope_dim", rope_dim), ("cache_len", cache_len))


def _mha_dims(head_dim, cache_len):
  return (("head_dim", head_dim), ("cache_len", cache_len))


def prepare_mla_window(slots, prefix_len, visibility, valid, *, heads: int, latent_dim: int,
                       rope_dim: int, cache_len: int, num_splits=None,
                       partial_dtype: str = "auto", rows_per_tile=None,
                       options=None) -> WindowMeta:
  """The window metadata of ``mla_tree_attention`` calls, built once for every layer of a step.

  ``mla_tree_attention(..., window_meta=prepare_mla_window(...))`` gives bit for bit what the same
  call without ``window_meta`` gives; it only skips rebuilding the metadata in each layer (one
  XLA fusion: 1.5 us of the 39.5 us call on the H200 at Kimi's per-GPU shape, b1/32k/q17).

  Args:
    slots, prefix_len, visibility, valid: the step's window, exactly as every call will get it.
    heads: query heads N; latent_dim, rope_dim: R and P of the queries and pools; cache_len: T,
      the pool's columns (``c_kv.shape[1]``).
    num_splits, partial_dtype, rows_per_tile, options: as the calls will pass them (they choose
      the row tiles).
  Returns:
    A ``WindowMeta``; a call whose shapes or plan differ raises ``ValueError`` naming them.
  """
  latent_p, rope_p = _round_up(latent_dim, 64), _round_up(rope_dim, 32)
  return _prepare("prepare_mla_window", slots, prefix_len, visibility, valid,
                  heads_per_group=heads, num_groups=1, key_dims=[latent_p, rope_p],
                  value_dim=latent_p, shared_value=True, cache_len=cache_len,
                  num_splits=num_splits, partial_dtype=partial_dtype, rows_per_tile=rows_per_tile,
                  options=options, call_dims=_mla_dims(latent_dim, rope_dim, cache_len))


def prepare_mha_window(slots, prefix_len, visibility, valid, *, heads: int, kv_heads: int,
                       head_dim: int, cache_len: int, num_splits=None,
                       partial_dtype: str = "auto", rows_per_tile=None,
                       options=None) -> WindowMeta:
  """``prepare_mla_window`` for ``mha_tree_attention``: N query heads over G = ``kv_heads``
  K/V heads of width D = ``head_dim`` in a pool of ``cache_len`` columns."""
  if kv_heads < 1:
    raise ValueError(f"prepare_mha_window: kv_heads is {kv_heads}; the kernel needs at least one")
  if heads % kv_heads:
    raise ValueError(f"prepare_mha_window: query heads {heads} not a multiple of kv heads "
                     f"{kv_heads}")
  dim_p = _round_up(head_dim, 64)
  return _prepare("prepare_mha_window", slots, prefix_len, visibility, valid,
                  heads_per_group=heads // kv_heads, num_groups=kv_heads, key_dims=[dim_p],
                  value_dim=dim_p, shared_value=False, cache_len=cache_len,
                  num_splits=num_splits, partial_dtype=partial_dtype, rows_per_tile=rows_per_tile,
                  options=options, call_dims=_mha_dims(head_dim, cache_len))


def _merge(o_part, lse_part, pl_: Plan, rows: int, *, skip_single: bool = True, interpret=None,
           live_counts=None):
  """Log-sum-exp merge of the per-split partials: ``_merge_kernel`` where ``merge`` asks for it
  (``_merge_kernel_applies``) and it fits (``interpret`` as in the attention call), else in XLA:
  the split weights, then a weighted sum (described below).

  Args:
    o_part: [BG, splits, n_rt, rows_stored, Dv] normalised partial outputs.
    lse_part: float32 [BG, splits, n_rt, Rt] base-2 log-sum-exp (-inf for an empty split).
    live_counts: None, or int32 [BG]: only splits below it were written (``Options.live_splits``);
      the others, whatever they hold (NaN included), are selected away, never multiplied by 0.
  Returns:
    float32 [BG, rows, Dv].

  The weight of split s for a row is 2^lse_s / sum_t 2^lse_t. "pairwise" computes it as
  1 / sum_t 2^(lse_t - lse_s) in one fusion (a term overflows to inf only when split s is
  negligible next to split t, which gives s the weight 0 it has in float32 anyway); "two_pass"
  subtracts the maximum first, one XLA kernel more. The partials lie splits-major with each
  split's row tiles contiguous, so the weighted sum reads them as [BG, splits, rows, Dv] (a
  reshape and a slice, no transpose) and writes [BG, rows, Dv] in one reduction fusion: 2
  epilogue kernels (stored [Dv, rows] they needed a transpose kernel more; with the split and
  row-tile axes the other way round XLA added a 6.6 us transpose). A one-pass variadic reduction
  carrying (max, weight sum, weighted sum) was slower (41 us at 44 splits).

  With one split (``skip_single``, the default) there is nothing to merge: see below.
  """
  bg_count, splits, n_rt, rs, dv = o_part.shape
  if splits == 1 and skip_single:
    # One split: its weight is 2^(lse - lse) = 1 exactly (0 where lse is -inf, a row that saw
    # nothing, which the kernel stores as zeros), so the weighted sum is the partial itself. No
    # merge kernels; a slice and a cast at most (bit-identical to the general path, tested).
    return o_part[:, 0].reshape(bg_count, n_rt * rs, dv)[:, :rows].astype(jnp.float32)
  columns = pl_.options.merge_columns or _default_merge_columns(bg_count * rows)
  if _merge_kernel_applies(pl_.options.merge, o_part, bg_count * rows) and _merge_kernel_fits(
      o_part.shape, lse_part.shape, columns, o_part.dtype.itemsize):
    return _merge_kernel(o_part, lse_part, rows, columns=columns, interpret=interpret,
                         live_counts=live_counts, pdl=pl_.options.pdl)
  lse = lse_part[..., :pl_.rows_stored]  # [BG, splits, n_rt, rs]
  if live_counts is not None:  # selects that XLA fuses into the two merge kernels
    written = jnp.arange(splits)[None, :] < live_counts[:, None]  # [BG, splits]
    lse = jnp.where(written[:, :, None, None], lse, -jnp.inf)
    o_part = jnp.where(written[:, :, None, None, None], o_part, jnp.zeros((), o_part.dtype))
  if pl_.options.merge == "two_pass":
    top = jnp.max(lse, axis=1, keepdims=True)
    weight = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top))
    total = jnp.sum(weight, axis=1, keepdims=True)
    weight = weight / jnp.where(total == 0.0, 1.0, total)  # a row no split saw: weights 0, not NaN
  else:
    lse_s, lse_t = lse[:, :, None], lse[:, None, :]
    terms = jnp.where(lse_t == -jnp.inf, 0.0, jnp.exp2(lse_t - lse_s))  # [BG, s, t, n_rt, rs]
    weight = jnp.where(lse == -jnp.inf, 0.0, 1.0 / jnp.sum(terms, axis=2))
  weight = weight.reshape(bg_count, splits, n_rt * rs)[:, :, :rows]
  o_all = o_part.reshape(bg_count, splits, n_rt * rs, dv)[:, :, :rows]
  # A broadcast-multiply-reduce (not an einsum) so that XLA fuses it into one reduction.
  return jnp.sum(weight[..., None] * o_all.astype(jnp.float32), axis=1)  # [BG, rows, Dv]


MERGE_SMEM_LIMIT = 200 * 1024  # bytes of one merge CTA's partials and log-sum-exps
# Merged rows (one merge-kernel CTA each) where merge="auto" takes the kernel: the cells it was
# timed faster in (H200, h8 b1 32k, q_len 9/17/33: 72/136/264 rows; h8 b1 q_len 1, 8 rows of 130
# splits, in 128-column blocks: 16.5 against 17.8 us per layer at 32k, 42.1 against 43.7 at 128k,
# ``bench_tree_attention_q1merge``); 9..71 rows are untimed (between timed cells), the upper bound
# has some margin. Untimed above it: at batch 32 or 64 heads it launches thousands of small CTAs;
# the XLA merge runs there.
MERGE_KERNEL_ROWS = (8, 512)
# The same for bf16 partials (the staged epilogue's): timed faster than the XLA merge at 136, 264
# and 520 rows (h8 b1 32k q17/q33/q65: 3.1 us against 6.5 per layer at q17; ``bench_tree_attention_
# epilogue``).
MERGE_KERNEL_ROWS_BF16 = (64, 520)


def _merge_kernel_applies(merge: str, o_part, merged_rows: int) -> bool:
  """Whether ``merge`` asks for the merge kernel here ("auto": ``MERGE_KERNEL_ROWS`` for fp32
  partials, ``MERGE_KERNEL_ROWS_BF16`` for bf16, where it was timed)."""
  if merge == "kernel":
    return True
  lo, hi = MERGE_KERNEL_ROWS if o_part.dtype == jnp.float32 else MERGE_KERNEL_ROWS_BF16
  return merge == "auto" and lo <= merged_rows <= hi


MERGE_COLUMNS = 256  # output columns per merge-kernel CTA (``Options.merge_columns`` = 0)
# Below this many merged rows, 128 columns a CTA (``MERGE_COLUMNS_FEW_ROWS``): more CTAs, more
# loads in flight, and a block of up to 256 splits fits. h8 b1 q_len 1 (8 rows, 130 splits), same
# run: 16.5 / 42.1 us per layer at 32k / 128k with 128 columns, 16.9 / 42.3 with 256
# (``bench_tree_attention_q1merge``; within the run-to-run spread, as 128 against 256 was at 136
# rows, see ``_merge_kernel``).
FEW_MERGED_ROWS = 64
MERGE_COLUMNS_FEW_ROWS = 128


def _default_merge_columns(merged_rows: int) -> int:
  """``Options.merge_columns`` = 0 resolved for this many merged rows (bg x rows)."""
  return MERGE_COLUMNS_FEW_ROWS if merged_rows < FEW_MERGED_ROWS else MERGE_COLUMNS


def _merge_chunk(dv: int, columns: int, itemsize: int = 4) -> int:
  """Columns per TMA box row of the merge kernel's loads: the widest that divides both Dv and
  the CTA's columns (a box dimension is at most 256 elements, a box row at least 16 bytes)."""
  return next(w for w in (256, 128, 64, 32, 16, 8, 4)
              if dv % w == 0 and columns % w == 0 and w * itemsize >= 16)


def _merge_columns(dv: int, columns: int) -> int:
  """Output columns per merge CTA: all of Dv where ``columns`` (0: ``MERGE_COLUMNS``) reaches it,
  else the largest of 512, 256 and 128 up to ``columns`` (128 at least) that divides Dv; Dv
  where none does.

  A block is a multiple of 128 columns because the kernel's warpgroup spreads the block over
  its 128 threads: Mosaic GPU's layout inference fails for 64- or 192-column blocks (jax 0.11.2,
  checked by lowering for CUDA), so ``_merge_kernel_fits`` rejects Dv without such a block (64,
  192, 320, 400: the XLA merge runs there)."""
  want = columns or MERGE_COLUMNS
  if want >= dv:
    return dv
  return next((c for c in (512, 256, 128) if c <= max(want, 128) and dv % c == 0), dv)


def _merge_kernel_fits(o_shape, lse_shape, columns: int = 0, itemsize: int = 4) -> bool:
  """Whether ``_merge_kernel`` takes these partials (``itemsize`` bytes each: fp32 or bf16): one
  CTA holds one row's ``columns`` of every split (the splits a TMA box dimension: at most 256) in
  shared memory, 16 bytes a box row at least, and reads its row's log-sum-exp in a box of four
  (Rt a multiple of 4, as every plan's row tile is), in column blocks of a multiple of 128
  (``_merge_columns``); else the XLA merge runs."""
  _, splits, _, _, dv = o_shape
  rt = lse_shape[-1]
  cols = _merge_columns(dv, columns)
  return (splits <= 256 and cols % 128 == 0
          and rt <= 256 and rt % 4 == 0
          and splits * (cols * itemsize + 16) <= MERGE_SMEM_LIMIT)


def _merge_kernel(o_part, lse_part, rows: int, *, columns: int = 0, interpret=None,
                  live_counts=None, pdl: bool = False):
  """The log-sum-exp merge as one Mosaic GPU kernel (``Options.merge="kernel"``).

  One CTA per output row (request-group ``bg``, row ``g`` of tile ``g // Rt``) and block of
  ``columns`` output columns (``_merge_columns``): one TMA box brings that row's columns from
  every split ([splits, columns], fp32 or bf16 as stored; bf16 is widened in registers, with no
  XLA conversion of the partials) and one the four log-sum-exps around the row ([splits, 4]:
  a TMA box needs 16 bytes a row); the weights are scalars (2^(lse_s - max_t lse_t), 0 for an
  empty split) and the row is their weighted sum over their sum, stored straight into the final
  [BG, rows, Dv] float32 layout. Only the real rows are read (the XLA merge reads them too, but
  in two kernels: the split weights, then the weighted sum). Column blocks, not whole rows, per
  CTA: at Kimi's goal cell (43 splits, 136 rows, Dv 512) whole rows (136 CTAs, one 88 KB box
  each) took 4.03-4.06 us, blocks of 256 columns (272 CTAs) 3.49-3.62 (``bench_tree_attention_
  mergecols.md``, H200, the default and a variant of the same configuration in one run) and of
  128 columns 3.65-3.68 (an earlier run that day, not kept): more loads in flight for the same
  12 MB. 256 over 128 is within that spread; whole rows are clearly slower.
  Requires ``_merge_kernel_fits``.

  Args/returns as ``_merge`` (o_part [BG, splits, n_rt, rs, Dv], lse_part [BG, splits, n_rt,
  Rt], live_counts None or int32 [BG]; float32 [BG, rows, Dv]). With ``live_counts`` the splits
  past a request's count are still loaded (one box) but weigh 0 and read split 0's finite row.
  """
  bg_count, splits, n_rt, rs, dv = o_part.shape
  rt = lse_part.shape[-1]
  cols = _merge_columns(dv, columns)
  width = _merge_chunk(dv, cols, o_part.dtype.itemsize)
  per_cta, chunks = cols // width, dv // width
  o_view = o_part.reshape(bg_count, splits, n_rt, rs, chunks, width)

  def body(*refs):
    pdl_prologue(pdl, interpret)
    if live_counts is None:
      o_ref, lse_ref, out_ref, o_smem, lse_smem, loaded = refs
    else:
      count_ref, o_ref, lse_ref, out_ref, o_smem, lse_smem, loaded = refs
    bg = lax.axis_index("bg")
    row = lax.axis_index("row")
    block = lax.axis_index("col")
    tile, r = lax.div(row, rt), lax.rem(row, rt)
    quad = pl.multiple_of(lax.mul(lax.div(r, 4), 4), 4)
    plgpu.copy_gmem_to_smem(lse_ref.at[bg, :, tile, pl.ds(quad, 4)], lse_smem, loaded)
    plgpu.copy_gmem_to_smem(o_ref.at[bg, :, tile, r, pl.ds(block * per_cta, per_cta)], o_smem, loaded)
    plgpu.barrier_wait(loaded)
    # Unrolled over the splits (a static count, at most 256): the shared-memory loads of all
    # splits can be in flight together instead of one loop iteration's latency each.
    lane = r - quad
    lse = [lse_smem[s, lane] for s in range(splits)]
    source = list(range(splits))
    if live_counts is not None:
      # Unwritten partials may hold anything (NaN, inf), which a weight of 0 would not cancel:
      # their log-sum-exps become -inf (weight 0) and their rows are read from split 0 instead,
      # which every request writes (selecting a whole row by a scalar does not lower: Mosaic
      # GPU has no implicit broadcast in warpgroup semantics, jax 0.11.2).
      count = count_ref[bg]
      lse = [jnp.where(s < count, x, -jnp.inf) for s, x in enumerate(lse)]
      source = [jnp.where(s < count, s, 0) for s in range(splits)]
    top = functools.reduce(jnp.maximum, lse)
    top = jnp.where(top == -jnp.inf, jnp.float32(0.0), top)  # no split saw the row: weights 0
    weights = [jnp.exp2(x - top) for x in lse]  # 0 for an empty split (lse -inf)
    acc = functools.reduce(lambda a, b: a + b,
                           [w * o_smem[src].astype(jnp.float32) for src, w in zip(source, weights)])
    total = functools.reduce(lambda a, b: a + b, weights)
    out_ref.at[bg, row, pl.ds(block * per_cta, per_cta)][...] = acc * (
        1.0 / jnp.where(total == 0.0, jnp.float32(1.0), total))

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((bg_count, rows, chunks, width), jnp.float32),
      scratch_types=[plgpu.SMEM((splits, per_cta, width), o_part.dtype),
                     plgpu.SMEM((splits, 4), jnp.float32),
                     plgpu.Barrier(num_arrivals=2)],
      grid=(bg_count, rows, dv // cols), grid_names=("bg", "row", "col"), kernel_name="tree_attention_merge",
      interpret=interpret)
  operands = (o_view, lse_part) if live_counts is None else (live_counts, o_view, lse_part)
  return kernel(*operands).reshape(bg_count, rows, dv)


def _as_bf16(x):
  return x if x.dtype == jnp.bfloat16 else x.astype(jnp.bfloat16)


def _pad_last(x, multiple: int):
  extra = _round_up(x.shape[-1], multiple) - x.shape[-1]
  if not extra:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def padded_cache_len(cache_len: int) -> int:
  """The pool length the kernel reads: TMA tiles need T >= one tile and tile-aligned clamped
  starts (T % 8 == 0). A pool of another length is padded to it in every call (a copy of the
  whole pool per layer), so callers that own the pool allocate this many columns."""
  return max(_round_up(cache_len, 8), BLOCK_KV)


def _pad_cache_len(pools):
  """The pools padded to ``padded_cache_len`` columns (no copy where they have them)."""
  cache_len = pools[0].shape[1]
  target = padded_cache_len(cache_len)
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


def _check_ranges(name, slots, prefix_len, valid, *, num_slots: int, cache_len: int):
  """The traced preconditions, checked where the values are concrete (a direct call, not one
  under jit): 0 <= slots < S and, for a request's real rows q, 0 <= prefix_len and
  prefix_len + q < T (padded rows may lie past the pool: a last prefill chunk). Out of range, the
  kernel's result would differ from the reference's silently (zeros for a slot past the pool, the
  padding of the pool's length attended past T)."""
  if any(isinstance(x, jax.core.Tracer) for x in (slots, prefix_len, valid)):
    return
  slots, prefix_len, valid = np.asarray(slots), np.asarray(prefix_len), np.asarray(valid)
  bad = np.flatnonzero((slots < 0) | (slots >= num_slots))
  if bad.size:
    raise ValueError(f"{name}: slots[{bad[0]}] = {slots[bad[0]]} is not a slot of the pool's {num_slots}")
  if not valid.size:
    return
  real = valid.any(axis=1)
  last_real = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)  # where real: its last real row
  bad = np.flatnonzero(real & ((prefix_len < 0) | (prefix_len + last_real >= cache_len)))
  if bad.size:
    b = bad[0]
    if prefix_len[b] < 0:
      raise ValueError(f"{name}: prefix_len[{b}] = {prefix_len[b]} is negative")
    raise ValueError(f"{name}: prefix_len[{b}] = {prefix_len[b]} puts its real window row {last_real[b]} past the "
                     f"pool's {cache_len} columns (0 <= prefix_len + q < {cache_len} for every real row q)")


def _check_call(name, *, widths: dict, scale, num_splits, interpret):
  """Checks what the kernel cannot take and returns ``interpret`` as interpret-mode params:
  zero widths or pool sizes, a traced or non-finite ``scale`` (static: it is compiled in), a
  ``num_splits`` below 1, and ``interpret=True`` (the usual Pallas idiom; Mosaic GPU needs its
  ``InterpretGPUParams``, whose defaults it then takes)."""
  for arg, size in widths.items():
    if size < 1:
      raise ValueError(f"{name}: {arg} is {size}; the kernel needs at least one")
  if isinstance(scale, (bool, jax.Array)) or not isinstance(scale, (int, float, np.floating)) or not np.isfinite(scale):
    raise TypeError(f"{name}: scale must be a finite Python float (it is compiled into the kernel), got {scale!r}")
  if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer))
                                 or num_splits < 1):
    raise ValueError(f"{name}: num_splits={num_splits!r} must be an int >= 1 (or None: from the SM count)")
  return interpret_params(interpret, f"{name}: interpret")


def _check_float(name, **arrays):
  for arg, x in arrays.items():
    if x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
      raise TypeError(f"{name}: {arg} must be bfloat16/float16/float32, got {x.dtype}")


def mla_tree_attention(q_latent, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid, *,
                       scale, interpret=None, num_splits=None, partial_dtype="auto",
                       rows_per_tile=None, options=None, window_meta=None):
  """Absorbed-MLA tree attention over one layer's latent cache pool (Mosaic GPU kernel).

  Same contract as ``reference.mla_tree_attention``. Preconditions, checked only where the values
  are concrete (not under jit): 0 <= slots < S; prefix_len >= 0 and prefix_len + q < T for
  every real row q. A padded row
  whose own column lies past the pool sees nothing and is 0; an empty batch, window or head axis
  gives an empty result.

  Args:
    q_latent: [B, Q, N, R] queries in the latent space; q_rope: [B, Q, N, P].
    c_kv: [S, T, R] latent cache pool; k_pe: [S, T, P] roped keys.
    slots, prefix_len: int32[B]; visibility: bool[B, Q, Q]; valid: bool[B, Q].
    scale: softmax scale.
    interpret: None on the GPU; ``plgpu.InterpretGPUParams(...)`` (or True: its defaults) runs the
      kernel on the CPU.
    num_splits: force the KV split count (tests, tuning); default from the SM count.
    partial_dtype: dtype of the per-split partial outputs: "float32", "bfloat16" or "auto"
      (default: bf16 where the queries are bf16 and the kernel stages the outputs in shared
      memory, see ``plan``; float32 otherwise).
    rows_per_tile: force the row tile (tests, tuning); default from ``plan``.
    options: kernel variants (``Options``, for the benchmark); default ``Options()``.
    window_meta: optional ``WindowMeta`` from ``prepare_mla_window`` for this window, shared by
      every layer of a step (the result is bit for bit the same; the window arguments are then
      only shape-checked, and a meta built for other shapes raises ``ValueError``).
  Returns:
    float32 [B, Q, N, R].
  """
  name = "mla_tree_attention"
  slots, prefix_len, visibility, valid = (jnp.asarray(x) for x in (slots, prefix_len, visibility, valid))
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
  interpret = _check_call(name, widths=dict(R=latent, P=rope, S=c_kv.shape[0], T=c_kv.shape[1]), scale=scale,
                          num_splits=num_splits, interpret=interpret)
  _check_ranges(name, slots, prefix_len, valid, num_slots=c_kv.shape[0], cache_len=c_kv.shape[1])
  if not batch * q_len * heads:
    return jnp.zeros((batch, q_len, heads, latent), jnp.float32)
  # Value width is a wgmma M dimension (multiple of 64); key widths are contraction dims.
  c_kv_p, k_pe_p = _pad_last(_as_bf16(c_kv), 64), _pad_last(_as_bf16(k_pe), 32)
  c_kv_p, k_pe_p = _pad_cache_len([c_kv_p, k_pe_p])
  q_lat = _pad_last(_as_bf16(q_latent), 64).reshape(batch, q_len * heads, -1)
  q_rp = _pad_last(_as_bf16(q_rope), 32).reshape(batch, q_len * heads, -1)
  attend = lambda q_lat, q_rp, c_kv_p, k_pe_p: _attend(
      [q_lat, q_rp], [c_kv_p[:, :, None], k_pe_p[:, :, None]], None,
      slots.astype(jnp.int32), prefix_len.astype(jnp.int32), visibility, valid,
      scale=scale, q_len=q_len, heads_per_group=heads, num_groups=1,
      interpret=interpret, num_splits=num_splits, partial_dtype=partial_dtype,
      rows_per_tile=rows_per_tile, options=options, window_meta=window_meta, name=name,
      call_dims=_mla_dims(latent, rope, c_kv.shape[1]), query_dtype=q_latent.dtype)
  out = forward_only(name, attend, q_lat, q_rp, c_kv_p, k_pe_p)
  return out[..., :latent].reshape(batch, q_len, heads, latent)


def mha_tree_attention(q, k, v, slots, prefix_len, visibility, valid, *, scale, interpret=None,
                       num_splits=None, partial_dtype="auto", rows_per_tile=None,
                       options=None, window_meta=None):
  """Grouped/multi-head tree attention over one layer's K/V pool (Mosaic GPU kernel).

  Same contract as ``reference.mha_tree_attention``.

  Args:
    q: [B, Q, N, D]; k, v: [S, T, G, D] with N a multiple of G.
    slots, prefix_len, visibility, valid, scale, interpret, num_splits, partial_dtype,
      rows_per_tile, options: as in ``mla_tree_attention``.
    window_meta: optional ``WindowMeta`` from ``prepare_mha_window`` (as in
      ``mla_tree_attention``).
  Returns:
    float32 [B, Q, N, D].
  """
  name = "mha_tree_attention"
  slots, prefix_len, visibility, valid = (jnp.asarray(x) for x in (slots, prefix_len, visibility, valid))
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"{name}: expected q [B,Q,N,D], k and v [S,T,G,D]; got {q.shape}, "
                     f"{k.shape}, {v.shape}")
  batch, q_len, heads, dim = q.shape
  if k.shape != v.shape or k.shape[-1] != dim:
    raise ValueError(f"{name}: k {k.shape} and v {v.shape} must match and end in D={dim}")
  groups = k.shape[2]
  if groups < 1:
    raise ValueError(f"{name}: k and v have no kv heads (G = 0)")
  if heads % groups:
    raise ValueError(f"{name}: query heads {heads} not a multiple of kv heads {groups}")
  _check_float(name, q=q, k=k, v=v)
  _check_window(name, slots, prefix_len, visibility, valid, batch, q_len)
  interpret = _check_call(name, widths=dict(D=dim, G=groups, S=k.shape[0], T=k.shape[1]), scale=scale,
                          num_splits=num_splits, interpret=interpret)
  _check_ranges(name, slots, prefix_len, valid, num_slots=k.shape[0], cache_len=k.shape[1])
  if not batch * q_len * heads:
    return jnp.zeros((batch, q_len, heads, dim), jnp.float32)
  rep = heads // groups
  k_p, v_p = _pad_last(_as_bf16(k), 64), _pad_last(_as_bf16(v), 64)
  k_p, v_p = _pad_cache_len([k_p, v_p])
  # Rows of one group: (q, r) for heads g * rep + r.
  qg = _pad_last(_as_bf16(q), 64).reshape(batch, q_len, groups, rep, -1)
  qg = qg.transpose(0, 2, 1, 3, 4).reshape(batch * groups, q_len * rep, -1)
  attend = lambda qg, k_p, v_p: _attend(
      [qg], [k_p], v_p, slots.astype(jnp.int32), prefix_len.astype(jnp.int32),
      visibility, valid, scale=scale, q_len=q_len, heads_per_group=rep,
      num_groups=groups, interpret=interpret, num_splits=num_splits,
      partial_dtype=partial_dtype, rows_per_tile=rows_per_tile, options=options,
      window_meta=window_meta, name=name, call_dims=_mha_dims(dim, k.shape[1]),
      query_dtype=q.dtype)
  out = forward_only(name, attend, qg, k_p, v_p)
  out = out[..., :dim].reshape(batch, groups, q_len, rep, dim).transpose(0, 2, 1, 3, 4)
  return out.reshape(batch, q_len, heads, dim)
