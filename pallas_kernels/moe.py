"""Grouped SwiGLU matmul for the routed MoE experts on the Mosaic GPU backend (bf16 and INT4).

Contract (the same as ``models.kimi.routed_experts``): ``x_sorted`` [A, H] holds token rows sorted
by expert, ``group_sizes`` [E] counts them, and the result [A, H] is
``down(silu(x @ gate) * (x @ up))`` per row through its expert; rows past ``sum(group_sizes)``
(padding, routed to no expert) come out zero.

Why a kernel: ``jax.lax.ragged_dot`` and jax's ``ragged_dot_mgpu`` read every expert's weights
whatever the routing; a decode or verify step touches few experts, so weight traffic should follow
the experts touched. Here work follows them:

* **Per-pair items** (``moe_experts_per_row``; ``moe_experts`` at A <= ``PER_ROW_MAX_ROWS``): one
  token's rows (top-8: distinct experts) are each their own item, with no work list at all (below).
  With ``item_programs`` below the pairs (by default where ``expected_rows`` is: an expert-parallel
  share, ``default_pair_programs``), a compact grid whose programs find the live pairs in their
  prologue (``_live_first``): the dead pairs of a step launch no programs of their own.
* **Work list** (``work_list`` in plain jnp, or the gate/up kernel itself: below): each non-empty
  expert's rows are covered by
  windows of ``block_rows`` (R) rows of x_sorted, starting at its first row rounded down to 8 (the
  bulk copy engine loads the kernel's x tile at 8-row-aligned starts), almost always one window
  (R from the expected rows an expert, ``default_block_rows``: 16 to 128 rows for bf16, to 64 for
  INT4; each window reads its expert's weights, which at prefill sizes sets the call's time).
  Slots are grouped per expert in expert order; the list has a static length (``max_work_items``),
  and slots without rows (an expert's spare last slot, and the tail) are marked ``-1``. The list
  is two masked-sum reductions (no cumsum or searchsorted kernels; given the sorted rows' experts,
  the rows' places come from a gather of A values instead of the [A, E] sum, 0.7 ms a call at
  prefill sizes), and no rows are copied: the gate/up kernel loads each item's R-row block
  straight from x_sorted. A block's rows of other experts cost no extra MMA work and their
  results are never read (each MMA output column depends only on its own row).
* **The list in the kernel** (``work_list_impl="kernel"``, the default up to
  ``KERNEL_WORK_LIST_MAX_EXPERTS``): the list's own kernels cost more than the list (four small
  XLA kernels, ~7 us a call at the 48-expert share), so each gate/up program finds its slots'
  items from ``group_sizes`` by one unrolled scalar pass over the experts (``slot_item``), and
  the programs of output tile 0 write the list for the down kernel and each routed row's place
  for the take (``KernelWork``). H200, 48 experts, INT4 (``moe_work_list.md``): T = 9 92.2 ->
  86.4 us a call, T = 17 130.9 -> 125.8, T = 136 354.1 -> 344.4; the same rows bit for bit.
* **Kernels**: one program per (output tile, work item). A program whose item is ``-1`` exits
  before loading anything, so weight tiles are read only for touched experts, once per item.
  The weight tile is the MMA's M side (64 output features) and the item's rows its N side
  (``block_rows`` >= 16), so few rows cost little tensor-core work (the "swap AB" form):
  ``acc[f, r] = sum_k W[k, f] x[r, k]``. The result is stored through a transposed shared-memory
  view, so every activation stays [rows, features].
  1. ``gate_up``: ``h = silu(x @ W_gate) * (x @ W_up)`` fused, bf16 [W * R, I] (the work layout:
     item w's block at rows [w * R, w * R + R)).
  2. ``down``: ``h @ W_down`` (float32 accumulation), bf16 [W * R, H]; one take brings the rows
     back to x_sorted's order.
  The routing weights and the sum back to tokens stay with the caller (``models.kimi.routed_block``),
  which already owns them: they cost O(A * H) against the O(touched * H * I) weight stream.
* **Compact grid** (sorted path, ``_visit_items``): the work list's length is a static bound far
  above the live items where few experts are touched, so the grid holds ``item_programs`` (about
  1.25 or 2 times the expected experts: ``ITEM_PROGRAMS_PER_EXPERT``) programs along the items,
  each taking slots g, g + G, ... below the list's slot count (read on the device); the slots past
  it cost nothing.
* **Chunks of K and the split** (``TileConfig.chunk_k``, ``split_k``; INT4's gate/up): a program
  sums K in fixed chunks of ``CHUNK_K`` features, each from zero in the MMA, and adds the chunks'
  sums in order. Where one program per (output tile, item) would leave SMs idle (the 48-expert
  share at one or two tokens), each chunk is its own program writing float32 sums, and a small
  kernel (``_fold_kernel``) adds them in the same order and applies the SiLU: 4x the programs at
  K2.6's widths, and the same rows bit for bit as the one-program form.
* **Weights**: bf16 in the model's layout (gate/up [E, H, I], down [E, I, H]; the tensor core
  transposes the tile for free), or INT4 kept packed on the device in ``KernelInt4Matrix``'s
  layout: K2.6's nibbles and bf16 scales, the nibbles permuted once (at load) inside blocks of
  256 input features so that each 32-bit word a thread loads holds exactly four bf16 pairs of
  its wgmma A-operand registers. A step's [64, 256] tile is dequantised by inline PTX (two
  16-byte shared-memory loads per row, then per word three shifts, four ``lop3``, four bf16x2
  subtractions and four multiplies by the scale: about two instructions per weight) and
  multiplied straight from registers. Mosaic GPU's own int4 path (per-byte loads and converts,
  then the scale) costs about twice that, and the kernel was bound by it (``tune_moe.md``).

Dimensions need not be multiples of the tiles: tiles past an edge are zero-filled by the bulk
copy engine on load and clipped on store (interpret mode models both). Layout limits are checked
up front with clear errors (feature sizes multiples of 16, INT4 inputs multiples of 32; the
packed layout pads K to a multiple of 256 with zero weights).

Measured on the H200 (``benchmarks/results/bench_moe.md``, one K2.6 layer, random top-8, 16 calls
in one executable, GPU time from CUPTI; the launch order is ``KernelTiles.grid_order``'s default):
bf16 runs at 91-97% of the touched experts' read roofline for T = 1..136 with 384 experts and
88-95% for T = 9..136 with the 48-expert share; INT4 at 60-75% for T = 9..136 with 384 experts
(the spread of runs of the same code; 63% at T = 1 with per-pair items, 54% with the sorted work
list) and 52-70% for T = 9..136 with 48, 24% at T = 1 (31% with the row ids and chunks of 1792,
``moe_chunk_k.md``; ``moe_waves.md``: what bounds the share's small T). At prefill sizes a call is
bound by the weight reads, once per work item (``default_block_rows``): bf16 at T = 4096 (85 rows
an expert, 128-row items) takes 0.48x the time of jax's ``ragged_dot_mgpu`` at 384 experts and
0.24x at the 48-expert share (``bench_moe_prefill.md``); INT4, capped at 64-row items, reaches
16-17% of its weight stream at T = 4096, likely bound by dequantising each weight tile once per
item (not profiled).
Where few experts are
touched the INT4 kernels are latency-bound: at 384 experts and T = 1 (256 gate/up programs, 172
registers a thread, so two programs and two warps per scheduler) ncu reads DRAM at 61% of its
peak and the schedulers issuing in 57% of cycles, with 0.81 eligible warps; a third pipeline
stage, 512-feature steps and tile-major weight words (each step's tile contiguous in memory)
changed the gate/up kernel by -3%, +24% and -3%. The plain-jnp work list, pad and take cost ~15
us a call there with the sorted work list; per-pair items (``PER_ROW_MAX_ROWS``, the default
there) leave 0.3-2.8 us. Wall time per call is higher at small T: XLA's host-side work per node
of the step's CUDA graph
(``benchmarks/moe_timeline.py``). Splitting K pays only where programs would otherwise leave SMs
idle: chosen per call (``tune_moe.md``) or as 2 static splits with float32 partials summed by
XLA it lost where 2 programs an SM were already live (384 experts T = 1 INT4 94-98 against 82
us, 48 experts T = 9 126-133 against 96 us); the chunked split of INT4's gate/up below one
program an SM saves 17-18% at 48 experts and T = 1, 2 (``INT4_TILES``); balanced programs
sharing the (tile, chunk) units evenly (stream-K, ``benchmarks/moe_balance.py``) gained the gate/up
kernel 3-5 us there but lost more to their fold. Each row's result
depends only on its own input (fixed tiles, K in fixed chunks in a fixed order), whatever the
other rows and whether the chunks were split.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector
import numpy as np

from pallas_kernels.forward_only import forward_only
from pallas_kernels.gpu_info import interpret_params, num_sms, pdl_prologue
from models.int4 import (GROUP_SIZE, PACK_BLOCK, Bf16Experts, Int4Experts, Int4Matrix,  # noqa: F401 (the kernel's API)
                         KernelInt4Matrix, from_kernel_layout, kernel_experts, kernel_layout_from_compressed_tensors,
                         kernel_layout_values, to_kernel_layout,
                         dequantize_experts, dequantize_int4, int4_from_compressed_tensors,
                         quantize_experts, quantize_int4)

TILE_N = 64  # output features per program: one warpgroup MMA of M = 64
MIN_BLOCK_ROWS = 16  # the down projection's B tile is [K, rows] bf16: 32-byte swizzle at least


# ---------------------------------------------------------------------------------------------
# Work list (plain jnp)
# ---------------------------------------------------------------------------------------------
ROW_ALIGN = 8  # block_start granularity: rows per tile of the swizzled shared-memory x tile


def max_work_items(num_experts: int, num_rows: int, block_rows: int) -> int:
  """Static bound on the item slots: sum_e ceil((r_e + 7) / R) <= n + (A + 7 n) // R, n = #non-empty."""
  n = min(num_experts, num_rows)
  return max(1, n + (num_rows + (ROW_ALIGN - 1) * n) // block_rows)


# Rows per work item at most. bf16: 128, the gate/up kernel's two [64, R] float32 accumulators then
# take 128 registers a thread (the MMA's N side would take 256 rows). INT4: 64, its gate/up kernel
# adds its chunks' sums into [64, R] float32 tiles in shared memory, which at R = 128 (64 KB) beside
# two 256-feature stages (82 KB each) pass the budget.
MAX_BLOCK_ROWS = {"bf16": 128, "int4": 64}


def default_block_rows(num_experts: int, num_rows: int, *, is_int4: bool) -> int:
  """Rows per work item: the expected rows per touched expert plus the up-to-7-row offset of an
  8-aligned window (``work_list``), as a power of two in [16, ``MAX_BLOCK_ROWS``], so that an
  expert's rows usually fit one window and its weights are read once.

  At prefill sizes that is what sets a call's time: each window reads its expert's weights again.
  H200, bf16, one K2.6 layer with the model's row ids, the default (128-row items with
  ``BF16_WIDE_ITEM_TILES``) against 64-row items, same run (``moe_prefill_rows.md``): T = 3072 (64
  rows an expert) 0.77x at 384 experts and 0.80x at the 48-expert share, T = 4096 0.67x / 0.70x,
  T = 8192 0.70x / 0.73x. At T = 2560 (53 rows an expert: 64-row items by this rule) 128-row items
  with ``BF16_TILES`` took 1.08x / 1.04x; with the wide tiles (0.93x of the layer at T = 4096) it
  was not timed, so the threshold is not settled against them. Below that the rule's choice (32
  rows at T = 512 and 1024, 64 at 2048) was the fastest of 16, 32 and 64 in every cell
  (``moe_rows_mid.md``). The rows are bit for bit the same whatever R."""
  per_expert = -(-num_rows // max(1, min(num_experts, num_rows))) + ROW_ALIGN - 1
  cap = MAX_BLOCK_ROWS["int4" if is_int4 else "bf16"]
  return min(cap, max(MIN_BLOCK_ROWS, 1 << (per_expert - 1).bit_length()))


ITEM_PROGRAMS_MIN = 8
# Programs along the items per expected touched expert: fewer where the gate/up kernel builds the
# work list (every program, dead or live, runs ``slot_item``'s pass over the experts). Same-run
# H200 comparisons, 2026-11-30, GPU us a call, INT4 (``moe_dequant_form.md``; scratch A/B runs,
# docs/moe.md): at the 48-expert share 1.25 against 2 takes T = 5 from 58.6 to 55.4 and T = 9 (with
# the serial form) from 88.6 to 83.5, T = 13..33 within 0.3%, T = 65 and 136 within 1.3%; at 384
# experts (the jnp list) 1.25 was 10% slower at T = 33 (1702 against 1551 us) and 5% faster at T =
# 17 (931 against 981) in two runs. bf16: within 0.3% either way at both expert counts. A routing
# that touches more experts than the grid holds runs a second round.
ITEM_PROGRAMS_PER_EXPERT = {"kernel": 1.25, "jnp": 2.0}


def default_item_programs(num_experts: int, expected_rows: int, w_items: int, work_list_impl: str = "jnp") -> int:
  """Programs along the work items of the sorted path (``_visit_items``):
  ``ITEM_PROGRAMS_PER_EXPERT[work_list_impl]`` times the experts a step of ``expected_rows`` is
  expected to touch (an expert's rows usually fit one item; the margin covers routings that touch
  more), at least ``ITEM_PROGRAMS_MIN``; all W slots where that is no fewer."""
  touched = expected_touched(num_experts, expected_rows)
  scale = ITEM_PROGRAMS_PER_EXPERT[work_list_impl]
  return min(w_items, max(ITEM_PROGRAMS_MIN, int(np.ceil(scale * touched))))


class WorkList(NamedTuple):
  expert: jax.Array  # int32[W]: the item's expert; -1: a slot without rows (between experts, tail)
  first_row: jax.Array  # int32[W]: its first row in x_sorted
  num_rows: jax.Array  # int32[W]: its rows (0 where expert is -1)
  block_start: jax.Array  # int32[W]: first row of the R-row block of x_sorted the kernel loads for it
  row_column: jax.Array  # int32[A]: each sorted row's position in the work layout [W * R]
  routed: jax.Array  # bool[A]: row < sum(group_sizes)
  num_slots: jax.Array  # int32[1]: the slots before the unused tail (every slot from here on is -1)


def padded_rows(num_rows: int, block_rows: int) -> int:
  """Rows x_sorted needs for the kernel's R-row blocks at 8-row-aligned starts (a multiple of 8)."""
  return -(-max(num_rows, block_rows) // ROW_ALIGN) * ROW_ALIGN


def work_list(group_sizes, num_rows: int, block_rows: int, sorted_expert_ids=None) -> WorkList:
  """Compact list of (expert, row window) items over the non-empty experts, in expert order.

  The kernels read each item's rows straight from x_sorted as the R-row block starting at
  ``block_start[w]``, which must be a multiple of 8 (the bulk copy engine's row tile in shared
  memory). So an expert's rows [s, e) are covered by windows of R rows from s rounded down to 8;
  the last window of x_sorted is moved back to end at ``padded_rows`` (the caller pads x_sorted
  to that many rows). A block's rows that belong to other experts or to padding cost no extra MMA
  work (the item's N side is R rows anyway), and their results are never read: every output
  column of the MMA depends only on its own row. Row a of x_sorted comes back from work-layout
  row ``row_column[a]``.

  Each non-empty expert gets ceil((rows + 7) / R) item slots, which depend on its size alone, so
  one fusion computes every prefix sum; a slot whose window starts past the expert's last row
  (possible only for the last one) is marked -1 like the unused tail. The static bound is loose
  by up to 7 rows per expert: at 384 experts and T = 136, 620 slots for ~363 live items; dead
  programs exit before loading anything (their cost is inside the bench numbers). The fields are
  two masked-sum reductions, each of several values at once: the prefix sums over [E, E], then
  every item's and every row's picks over [W + A, E]. On the H200 that is about 4 kernels with
  the output's take, against 7 when each value had its own sum (glue 10.2 -> 8.3 us a call at 48
  experts and T = 9, 10.6 -> 7.7 at T = 17; small kernels cost 1-2 us each whatever their size).
  (XLA's cumsum is a reduce-window kernel of ~10 us on the H200; the first cumsum/searchsorted/
  gather form launched nine small kernels.)

  With ``sorted_expert_ids`` (int[A], each sorted row's expert, E or more for padding; the model has
  them from its sort) each row's column is gathered from its expert's values instead of picked
  from [A, E]: O(A), where the picks cost 0.7 ms a call at 384 experts and T = 4096 (H200). The
  same list; ids that disagree with ``group_sizes`` (a routed row outside its id's rows) give an
  empty list (every row unrouted: zeros out), never rows of other experts.
  """
  e = group_sizes.shape[0]
  r = block_rows
  w_max = max_work_items(e, num_rows, r)
  last_window = padded_rows(num_rows, r) - r
  # A negative count is no rows; more than A is A (rows past A are cut anyway, and counts near
  # 2**31 would wrap the prefix sums).
  sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, num_rows)
  slots = jnp.where(sizes > 0, (sizes + ROW_ALIGN - 1 + r - 1) // r, 0)
  experts = jnp.arange(e, dtype=jnp.int32)
  upto = experts[None, :] <= experts[:, None]  # [E, E']: e' <= e
  ends = _picks(upto, jnp.broadcast_to(jnp.stack([slots, sizes], 1)[None], (e, e, 2)))
  slot_end, row_end = ends[:, 0], ends[:, 1]
  slot_start, row_start = slot_end - slots, row_end - sizes
  base = row_start - row_start % ROW_ALIGN
  member_w, window = _item_candidates(slot_start, slot_end, row_end, base, None, w_max, r)
  rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
  routed = rows[:, 0] < row_end[-1]
  if sorted_expert_ids is not None:
    raw = _padding_as_e(sorted_expert_ids, e)
    ids = jnp.clip(raw, 0, e - 1)
    row = rows[:, 0]
    # Ids out of step with the counts would take rows from other experts' results: none are live.
    agree = jnp.all(~routed | ((raw >= 0) & (raw < e) & (row_start[ids] <= row) & (row < row_end[ids])))
    routed = routed & agree
    column = jnp.where(routed, _row_column(row, base[ids], slot_start[ids], r, last_window), 0)
    expert, first_row, item_rows, block_start = _items_from(
        _picks(member_w, _item_values(window, experts, row_start, row_end)), r, last_window)
    return WorkList(jnp.where(agree, expert, -1), jnp.where(agree, first_row, 0), jnp.where(agree, item_rows, 0),
                    jnp.where(agree, block_start, 0), row_column=column, routed=routed,
                    num_slots=jnp.where(agree, slot_end[-1:], 0))
  member_a = (row_start[None, :] <= rows) & (rows < row_end[None, :])  # [A, E]
  column = _row_column(rows, base[None, :], slot_start[None, :], r, last_window)
  # The items' picks and the rows' columns in one reduction: [W + A, E, 5], the rows' column in
  # the first value.
  values_a = jnp.pad(column[..., None], ((0, 0), (0, 0), (0, ITEM_VALUES - 1)))
  picked = _picks(jnp.concatenate([member_w, member_a]),
                  jnp.concatenate([_item_values(window, experts, row_start, row_end), values_a]))
  return WorkList(*_items_from(picked[:w_max], r, last_window), row_column=picked[w_max:, 0],
                  routed=routed, num_slots=slot_end[-1:])


def _padding_as_e(sorted_expert_ids, num_experts: int):
  """int32 ids with every padding id (E or more, of any integer type and size) exactly E; negative
  ids stay negative (a caller's error, which the lists reject)."""
  return jnp.minimum(sorted_expert_ids, num_experts).astype(jnp.int32)


def _picks(member, values):
  """[N, k]: the k values of the one group g where member[n, g] holds (at most one does), else 0:
  one masked-sum reduction over [N, G, k]."""
  return jnp.sum(jnp.where(member[..., None], values, 0), axis=1)


ITEM_VALUES = 5  # what an item takes from its group (``_item_values``)


def _item_candidates(slot_start, slot_end, row_end, base, group_live, w_max, r):
  """([W, G] bool, [W, G] int32): whether item slot w is group g's, and its window's first row.
  Group g (an expert with rows, or in ``work_list_from_rows`` the first row of a run where
  ``group_live`` holds) owns item slots [slot_start, slot_end), whose windows of R rows start at
  its 8-aligned ``base``; a slot whose window starts past the group's rows is no one's."""
  items = jnp.arange(w_max, dtype=jnp.int32)[:, None]
  window = base[None, :] + (items - slot_start[None, :]) * r  # [W, G]
  member = (slot_start[None, :] <= items) & (items < slot_end[None, :]) & (window < row_end[None, :])
  if group_live is not None:
    member = member & group_live[None, :]
  return member, window


def _item_values(window, expert, row_start, row_end):
  """[W, G, ITEM_VALUES]: window start, the group's rows [start, end), its expert, and 1 (live)."""
  shape = window.shape
  return jnp.stack([window, *(jnp.broadcast_to(v[None, :], shape) for v in (row_start, row_end, expert)),
                    jnp.ones(shape, jnp.int32)], axis=-1)


def _items_from(picked, r, last_window):
  """(expert, first_row, num_rows, block_start) [W] from each slot's picked ``_item_values``
  (all 0 for a slot that is no one's: expert -1)."""
  window, row_start, row_end, expert, live = (picked[:, i] for i in range(ITEM_VALUES))
  live = live > 0
  first_row = jnp.maximum(row_start, window)
  last_row = jnp.minimum(row_end, window + r)
  return (jnp.where(live, expert, -1), jnp.where(live, first_row, 0), jnp.where(live, last_row - first_row, 0),
          jnp.where(live, jnp.minimum(window, last_window), 0))


def _row_column(rows, base, slot_start, r, last_window):
  """Each sorted row's position in the work layout, given its group's ``base`` and ``slot_start``
  (broadcasting): its window's item slot times R plus its offset in that (moved-back) window."""
  slot = (rows - base) // r
  row_window = base + slot * r
  return (slot_start + slot) * r + rows - jnp.minimum(row_window, last_window)


# The work list inside the gate/up kernel (``work_list_impl="kernel"``): each program finds its
# slots' items from the counts by one pass over the experts, unrolled (scalars), so the call runs
# no work-list kernels of its own. Up to this many experts (the 48-expert share under 8-way
# expert parallelism); past it the pass would outgrow the kernel's prologue and the jnp list runs.
KERNEL_WORK_LIST_MAX_EXPERTS = 64


class SlotItem(NamedTuple):
  """``work_list``'s fields of one item slot, as scalars (expert -1: a slot without rows)."""
  expert: jax.Array
  first_row: jax.Array
  num_rows: jax.Array
  block_start: jax.Array


def slot_item(sizes, w, *, block_rows: int, last_window: int, num_rows: int):
  """Item slot ``w`` of ``work_list(sizes, ...)`` by one unrolled pass over the experts' counts
  (``sizes``: int32[E], a ref or an array): (``SlotItem``, the list's ``num_slots``, the rows'
  end before any cut at A). The same arithmetic as ``work_list``, on scalars, so that it runs in
  a kernel's prologue: per expert a load and about a dozen integer operations."""
  r = block_rows
  slot_end = row_end = jnp.int32(0)
  expert = jnp.int32(-1)
  hit_slot_start = hit_start = hit_size = jnp.int32(0)
  for e in range(sizes.shape[0]):
    size = jnp.clip(sizes[e], 0, num_rows)  # as work_list reads the counts
    # Unsigned (size >= 0): a shift where R is a power of two.
    slots = lax.div((size + (ROW_ALIGN - 1 + r - 1)).astype(jnp.uint32), jnp.uint32(r)).astype(jnp.int32)
    slots = jnp.where(size > 0, slots, 0)
    slot_start, start = slot_end, row_end
    slot_end, row_end = slot_end + slots, row_end + size
    hit = (slot_start <= w) & (w < slot_end)  # at most one expert: the empty ones own no slots
    expert = jnp.where(hit, jnp.int32(e), expert)
    hit_slot_start, hit_start, hit_size = (jnp.where(hit, new, old) for new, old in
                                           ((slot_start, hit_slot_start), (start, hit_start), (size, hit_size)))
  window = (hit_start & jnp.int32(-ROW_ALIGN)) + (w - hit_slot_start) * r
  hit_end = hit_start + hit_size
  live = (expert >= 0) & (window < hit_end)  # a spare last slot starts past its expert's rows
  first_row = jnp.maximum(hit_start, window)
  last_row = jnp.minimum(hit_end, window + r)
  item = SlotItem(jnp.where(live, expert, -1), jnp.where(live, first_row, 0), jnp.where(live, last_row - first_row, 0),
                  jnp.where(live, jnp.minimum(window, last_window), 0))
  return item, slot_end, row_end


def work_list_from_rows(sorted_expert_ids, num_experts: int, block_rows: int) -> WorkList:
  """``work_list`` from each sorted row's expert instead of the experts' row counts.

  The same ``WorkList``, field for field, for ``sorted_expert_ids`` int[A] in ascending order
  (an id of ``num_experts`` or more marks a padding row; those sort last), i.e. for group_sizes =
  its counts of each id below E. Here the experts are the runs of equal ids, so the prefix sums
  are masked sums over [A, A] and the item picks over [W, A], not [E, E] and [W, E]: cheaper
  where a step routes fewer rows than there are experts (decoding and small trees: 8 rows a token
  against 384 experts). The caller has these ids from its sort (in ``models/kimi.py``,
  ``flat_ids[order]``: a gather of A ints). Ids not in ascending order give an empty list (every
  row unrouted: zeros out), never items of wrong experts or reads outside the arrays.
  """
  ids = _padding_as_e(sorted_expert_ids, num_experts)
  a = ids.shape[0]
  r = block_rows
  w_max = max_work_items(num_experts, a, r)
  last_window = padded_rows(a, r) - r
  rows = jnp.arange(a, dtype=jnp.int32)
  # A negative id is a caller's error: no rows are routed (zeros out), as work_list does.
  ascending = jnp.all(ids[1:] >= ids[:-1]) & jnp.all(ids >= 0)
  routed = (ids < num_experts) & ascending
  # Row a's run of equal ids (its expert's rows): [row_start, row_end).
  row_start = jnp.sum(ids[None, :] < ids[:, None], axis=1, dtype=jnp.int32)
  row_end = jnp.sum(ids[None, :] <= ids[:, None], axis=1, dtype=jnp.int32)
  first = routed & (rows == row_start)  # one row per touched expert: its run's first
  run_slots = jnp.where(routed, (row_end - row_start + ROW_ALIGN - 1 + r - 1) // r, 0)
  # Item slots of the runs before row a's run (as work_list's slot_start of a's expert).
  earlier = first[None, :] & (rows[None, :] < row_start[:, None])  # [A, A']
  slot_start = jnp.sum(jnp.where(earlier, run_slots[None, :], 0), axis=1)
  slot_end = slot_start + run_slots
  base = row_start - row_start % ROW_ALIGN
  member, window = _item_candidates(slot_start, slot_end, row_end, base, first, w_max, r)
  items = _items_from(_picks(member, _item_values(window, ids, row_start, row_end)), r, last_window)
  column = _row_column(rows, base, slot_start, r, last_window)
  return WorkList(*items, row_column=jnp.where(routed, column, 0), routed=routed,
                  num_slots=jnp.sum(jnp.where(first, run_slots, 0), keepdims=True))


# ---------------------------------------------------------------------------------------------
# One item per (token, slot): decoding a single token
# ---------------------------------------------------------------------------------------------
# A token's top-k experts are distinct, so where the rows are one token's k slots, giving each
# (token, slot) pair its own work item reads every touched expert once with no sort, no work list
# and no copy of the rows: the items' experts are the routing ids themselves (an id outside
# [0, E) makes its programs exit, like -1), each item loads the R-row block of the tokens that
# holds its token (rows past the tokens are zero-filled by the bulk copy engine, so the tokens
# need no padding) and its result sits at a static row of the work layout. With more pairs,
# pairs that share an expert would each read it, so the sorted work list takes over. 8 pairs:
# one K2.6 token (top-8). Whatever the ids, items chosen by this rule never read more than 8
# experts' tiles.
PER_ROW_MAX_ROWS = 8


def per_row_layout(num_tokens: int, top_k: int, block_rows: int):
  """Static layout of ``num_tokens x top_k`` per-pair items (item w = token w // top_k, slot
  w % top_k): (block_start int32[W], the first token row of the R-row block item w loads;
  position int32[W], the work-layout row of item w's result)."""
  token = np.arange(num_tokens * top_k, dtype=np.int32) // top_k
  block_start = token - token % ROW_ALIGN
  position = np.arange(num_tokens * top_k, dtype=np.int32) * block_rows + token - block_start
  return block_start, position


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
SMEM_BUDGET = 200 * 1024  # of the H200's 227 KiB per block, leaving room for barriers


# With ``chunk_k`` set, a program sums K in fixed chunks of that many input features: each chunk's
# products accumulate from zero in the MMA, and the chunks' sums are then added in order in
# float32, ((0 + c0) + c1) + ... Whether one program runs all chunks or each chunk is its own
# program (``split_k``: its sums added by ``_fold_kernel`` or in the take), every row's result is
# then the same bit for bit, so the split can follow the expected work (few experts: more
# programs) without a row depending on how many rows share its call. 1792: K2.6's gate/up K =
# 7168 gives 4 chunks, a lone expert's 32 output tiles 128 split programs, about one an SM. H200,
# same run (``results/moe_chunk_k.md``), against 1024 (7 chunks, 224 programs: the first choice):
# the split per-pair call at T = 1 0.90x at the 48- and 96-expert shares (INT4 15.5 -> 14.1 and
# 32.2 -> 29.1 us: gate/up and fold both faster), 3584 (2 chunks, 64 programs) 1.01-1.04x; where
# nothing splits (the 48-expert share's sorted path, T = 9 and 17) 1.00x either way.
CHUNK_K = 1792


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Static tiling of one kernel: input features per pipeline step, pipeline depth, the fixed
  chunks of K summed apart (``chunk_k``, see ``CHUNK_K``; None: K in one sum), and whether each
  chunk is its own program (``split_k``: float32 chunk sums added after the kernel; for few items,
  where one program per output tile leaves SMs idle). Configs with equal ``block_k`` and
  ``chunk_k`` give the same rows bit for bit, split or not."""

  block_k: int
  stages: int
  chunk_k: int | None = None
  split_k: bool = False

  def __post_init__(self):
    if self.block_k < 16 or self.block_k % 16 or (self.chunk_k is not None and self.chunk_k % self.block_k):
      raise ValueError(f"TileConfig: block_k={self.block_k} must be a positive multiple of 16 (the MMA's K step) "
                       f"and divide chunk_k={self.chunk_k}")
    if self.stages < 2:  # one stage cannot load a step while the MMAs read the last
      raise ValueError(f"TileConfig: stages={self.stages} must be >= 2")
    if self.split_k and self.chunk_k is None:
      raise ValueError("TileConfig: split_k needs chunk_k (the chunks each program takes)")


@dataclasses.dataclass(frozen=True)
class KernelTiles:
  """Tiling of the two kernels of one call (static: a jit argument, for tuning sweeps)."""

  gate_up: TileConfig
  down: TileConfig
  # Launch order of the (output tile, work item) programs; Mosaic GPU runs the last grid axis
  # fastest. "tile_minor" (default): consecutive programs take consecutive output tiles of one
  # item, which reuse its input rows while they are in L2. "item_minor": consecutive items of one
  # output tile, so each item's rows are re-read once per sweep over all items (the down kernel's
  # rows are R x I bf16 per item: ~24 MB at 384 experts and T = 136, ~50 MB at T = 544). Same run
  # on the H200 (bench_moe.md), GPU time tile_minor / item_minor: 0.79-0.97x in every bf16 cell
  # but one (48 experts, T = 9: 1.04x) and 0.82-0.99x in every INT4 cell but two (384 experts,
  # T = 9 and 17: 1.04x, 1.01x); 0.79x and 0.82x at T = 544, where the down kernel's time falls
  # from 2128 to 1290 us (INT4).
  grid_order: str = "tile_minor"
  # Programmatic dependent launch (``gpu_info.pdl_prologue``): each kernel of the call may be launched
  # while the one before it finishes, and waits for it before reading anything. H200: 0.999-1.015x
  # at the 48-expert share (benchmarks/results/pdl.md: no launch gaps to close), so off.
  pdl: bool = False

  def __post_init__(self):
    if self.grid_order not in ("item_minor", "tile_minor"):
      raise ValueError(f"KernelTiles.grid_order={self.grid_order!r}: expected 'item_minor' or 'tile_minor'")


# From benchmarks/tune_moe.py on the H200 (benchmarks/results/tune_moe.md). bf16: depths that
# keep >= 64 KiB of weight tiles in flight per SM with two programs per SM. INT4: one PACK_BLOCK
# (256 features) per step, two deep, beat 512-feature steps and three-deep pipelines.
# INT4's gate/up kernel sums K in chunks (``CHUNK_K``) so that it can split where few experts are
# touched (``default_tiles``). One H200 run per comparison, 2026-11-30 (chunks of 1024; 1792 since
# 2026-12-01, ``CHUNK_K``), against one sum over K:
# the chunks cost 1-2.5% where nothing splits (48 experts T = 17: 132.4 -> 134.9 us a call; 384
# experts T = 1: 69.1 -> 69.9); the split gate/up saves 17% at 48 experts and T = 1 (28.6 -> 23.8
# us: the gate/up kernel 18.9 -> 11.2, plus a 2.4 us fold kernel) and 18% at T = 2 (46.5 -> 38.2,
# with the compact grid). Splitting the down kernel too (2 chunks) did not pay (24.3 vs 23.7 us
# at T = 1: the gather of its chunk sums costs what the split saves), so it takes one sum. bf16
# takes one sum in both: its split gained nothing at T = 1 (37.1 vs 37.3 us, the fold kernel
# eating the gate/up's 3.6 us gain), and its chunks cost 2% in the step (they stop its MMAs from
# staying in flight across steps) or up to 6% as a pipeline per chunk.
BF16_TILES = KernelTiles(gate_up=TileConfig(block_k=64, stages=4), down=TileConfig(block_k=128, stages=4))
INT4_TILES = KernelTiles(gate_up=TileConfig(block_k=256, stages=2, chunk_k=CHUNK_K),
                         down=TileConfig(block_k=256, stages=2))


# bf16 gate/up where a step is expected to run at most one program per two SMs (about two
# experts' 32 output tiles: the 48-expert share at one token). Alone on its SM a program streams
# at its bytes in flight over the memory latency, so a ring twice as deep pays; from ~4 experts on
# it gains nothing (H200, the kernel alone, ``moe_waves.md``: 1 and 2 items 33.7 -> 25.2 and 38.0
# -> 28.3 us; 4 items 53.7 -> 53.9; 64 items 776 -> 804). Same block_k, so the same products in
# the same order: the rows are bit for bit those of ``BF16_TILES``. INT4 steps are bound by their
# dequantisation, not by the loads: four stages gained nothing there at any item count.
BF16_FEW_PROGRAMS_TILES = dataclasses.replace(BF16_TILES, gate_up=TileConfig(block_k=64, stages=8))

# bf16 with items of more than 64 rows (prefill sizes, ``default_block_rows``): the down kernel's
# 128-feature steps of 128 rows take 48 KB a stage, so four do not fit (``_fit_stages`` keeps three)
# and a 160 KB program has its SM alone; 64-feature steps take 24 KB, and two 112 KB programs share
# an SM. H200, one K2.6 layer at T = 4096, 128-row items, same run (``moe_prefill_rows.md``): the
# down kernel 4442 -> 3467 us at 384 experts, 497 -> 405 at the 48-expert share (the last of 3
# timings; the layer 0.93x, 0.94x, medians). The same products in the same order over K (bf16 takes one sum; the GPU's MMAs add K in
# 16-feature steps whatever the tile): the rows are bit for bit those of ``BF16_TILES`` there.
BF16_WIDE_ITEM_TILES = dataclasses.replace(BF16_TILES, down=TileConfig(block_k=64, stages=4))


def expected_touched(num_experts: int, expected_rows: int) -> float:
  """Experts a step of ``expected_rows`` uniformly routed rows is expected to touch."""
  return num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** max(1, expected_rows))


def default_tiles(experts, expected_rows: int | None = None, block_rows: int | None = None) -> KernelTiles:
  """The tuned tiles of the weights' format, adjusted where ``expected_rows`` (rows routed to these
  experts) leaves SMs idle: INT4 splits its gate/up kernel (``split_k``: a program per chunk of K,
  4x the programs at K2.6's sizes) where its programs (touched experts x output tiles) are
  expected to fit one per SM; bf16 takes a deeper gate/up ring where at most one gate/up program
  per two SMs is expected, and shorter down steps for items of more than 64 rows (``block_rows``).
  Every choice gives the same rows bit for bit."""
  if isinstance(experts, Int4Experts):
    tiles = INT4_TILES
    if expected_rows is not None:
      touched = expected_touched(experts.gate.num_experts, expected_rows)
      if touched * pl.cdiv(experts.gate.out_features, TILE_N) <= num_sms():
        tiles = dataclasses.replace(tiles, gate_up=dataclasses.replace(tiles.gate_up, split_k=True))
    return tiles
  if block_rows is not None and block_rows > 64:
    return BF16_WIDE_ITEM_TILES
  deep = BF16_FEW_PROGRAMS_TILES.gate_up
  if expected_rows is not None:
    num_experts, hidden, inter = experts[0].shape
    few = expected_touched(num_experts, expected_rows) * pl.cdiv(inter, TILE_N) <= num_sms() // 2
    if few and pl.cdiv(hidden, deep.block_k) >= 2 * deep.stages:  # a ring deeper than the steps is moot
      return BF16_FEW_PROGRAMS_TILES
  return BF16_TILES


def _smem_bytes(cfg: TileConfig, num_w: int, is_int4: bool, smem_dequant: bool, block_rows: int,
                stages: int, fixed: int) -> int:
  bk = cfg.block_k
  if is_int4:
    weights = num_w * (TILE_N * bk // 2 + bk // GROUP_SIZE * TILE_N * 2)
  else:
    weights = num_w * bk * TILE_N * 2
  per_stage = weights + block_rows * bk * 2
  return stages * per_stage + fixed + (num_w * TILE_N * bk * 2 if smem_dequant else 0)


def _fit_stages(cfg: TileConfig, num_w: int, is_int4: bool, smem_dequant: bool, block_rows: int,
                fixed: int) -> int:
  """The configured depth, shallower if the tiles (and ``fixed`` bytes of scratch) would not fit
  in shared memory."""
  stages = cfg.stages
  size = functools.partial(_smem_bytes, cfg, num_w, is_int4, smem_dequant, block_rows, fixed=fixed)
  while stages > 2 and size(stages) > SMEM_BUDGET:
    stages -= 1
  used = size(stages)
  if used > SMEM_BUDGET:
    raise ValueError(f"block_rows={block_rows} needs {used} bytes of shared memory (> {SMEM_BUDGET}); "
                     "use fewer rows per work item")
  return stages


def _swizzle_elems(*dims: int) -> int:
  """Largest bf16 swizzle atom (64, 32 or 16 elements) dividing every dim.

  The bulk copy engine tiles global memory by the atom, so the global minor dimension must be a
  multiple of it; the MMA's two shared-memory operands must share one swizzle.
  """
  for atom in (64, 32, 16):
    if all(d % atom == 0 for d in dims):
      return atom
  raise ValueError(f"dimensions {dims} must be multiples of 16")


def _bf16_transforms(atom: int):
  return (plgpu.TilingTransform((8, atom)), plgpu.SwizzleTransform(atom * 2))


def _silu_mul(gate, up):
  return gate / (1.0 + jnp.exp(-gate)) * up


# Packed words of the kernel layout: 128-byte rows (one PACK_BLOCK of 256 features), 128-byte swizzle.
WORDS_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
# Per 32-bit word $4 (8 nibbles, two per bf16 pair) and scale word $5 (prmt {sel} copies the word's
# group scale into both halves): value = (128 + nibble) - 136 = q, exact in bf16, then one rounding
# of q * scale, into $0..$3. lop3 0xEA is (a & b) | c.
_DEQUANT_WORD_PTX = "\n".join([
    "{{", ".reg .b32 s, t, k;", "prmt.b32 s, $5, $5, {sel};", "mov.b32 k, 0x43084308;",
    *(line for j in range(4) for line in (
        *([f"shr.u32 t, $4, {4 * j};"] if j else []),  # nibble j of each half to bits 0-3 / 16-19
        f"lop3.b32 t, {'t' if j else '$4'}, 0x000F000F, 0x43004300, 0xEA;",
        "sub.bf16x2 t, t, k;",
        f"mul.rn.bf16x2 ${j}, t, s;")),
    "}}"])


def _dequant_words_registers(words_smem, scale_smem, block_k: int):
  """bf16 [TILE_N, block_k] in the wgmma register layout from one step's packed words (GPU).

  Each thread reads its two rows' 32-byte runs of words (two 16-byte loads per row and block,
  bank-conflict free under the 128-byte swizzle) and its rows' scales (one 16-byte load per
  block), and turns every word into four bf16 pairs (``_DEQUANT_WORD_PTX``): about two
  instructions per weight, against about four for a per-byte int4 load and convert.
  """
  blocks = block_k // PACK_BLOCK
  layout = mgpu_fa.WGMMA_LAYOUT

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(WORDS_TRANSFORMS), plgpu.RefType()),
      return_type=plgpu.ShapeDtypeStruct((TILE_N, block_k), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
  def dequant(ctx, words_ref, scale_ref):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    c = lambda v: arith.constant(i32, v)
    v4 = ir.VectorType.get((4,), i32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    warp = arith.shrui(tid, c(5))
    lane = arith.andi(tid, c(31))
    col_pair = arith.andi(lane, c(3))  # t: the thread's column pair in each 8-column tile
    row8 = arith.shrui(lane, c(2))  # the row inside an 8-row tile
    words_ptr = mgpu_utils.memref_ptr(words_ref)
    scale_ptr = mgpu_utils.memref_ptr(scale_ref)

    def load16(ptr, byte_offset):
      return llvm.load(v4, mgpu_utils.getelementptr(ptr, [byte_offset], i8), alignment=16)

    regs = np.empty(layout.registers_shape((TILE_N, block_k)), dtype=object)
    for half in range(2):
      row_tile = arith.addi(arith.muli(warp, c(2)), c(half))  # (16 warp + 8 half + row8) // 8
      row = arith.addi(arith.muli(row_tile, c(8)), row8)
      scale_row = arith.muli(row, c(block_k // GROUP_SIZE * 2))
      for blk in range(blocks):
        scales = load16(scale_ptr, arith.addi(scale_row, c(blk * 16)))  # this row's 8 group scales
        tile_base = arith.addi(arith.muli(arith.addi(arith.muli(row_tile, c(blocks)), c(blk)), c(1024)),
                               arith.muli(row8, c(128)))
        for chunk in range(2):
          logical = arith.addi(arith.muli(col_pair, c(2)), c(chunk))  # 16-byte chunk of the row
          swizzled = arith.xori(logical, row8)
          data = load16(words_ptr, arith.addi(tile_base, arith.muli(swizzled, c(16))))
          for w in range(4):
            word_idx = 4 * chunk + w  # i: also the 32-feature group inside the block
            word = vector.extract(data, dynamic_position=[], static_position=[w])
            scale_word = vector.extract(scales, dynamic_position=[], static_position=[word_idx // 2])
            sel = "0x1010" if word_idx % 2 == 0 else "0x3232"
            outs = mgpu_utils.inline_ptx(_DEQUANT_WORD_PTX.format(sel=sel), word, scale_word,
                                         result_types=[i32] * 4)
            for j, out in enumerate(outs):
              u = blk * 32 + 4 * word_idx + j  # 8-column tile of the [64, block_k] operand
              regs[0, u, 0, 0, half, 0, 0, 0, 0] = mgpu_utils.bitcast(out, pair)
    return mgpu_fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return dequant(words_smem, scale_smem)


def _dequant_words_jnp(words_smem, scale_smem, block_k: int):
  """The same tile in plain jnp (interpret mode, which cannot run inline Mosaic GPU code)."""
  values = kernel_layout_values(words_smem[...], block_k).astype(jnp.float32)  # [TILE_N, block_k]
  scale = jnp.repeat(scale_smem[...].astype(jnp.float32), GROUP_SIZE, axis=1)
  return (values * scale).astype(jnp.bfloat16)


def _k_pipeline(accs, w_refs, x_rows, *, n, first, num_steps, is_int4: bool, bk: int, k_steps: int, x_atom: int,
                stages: int, int4_dequant: str, deq_smem, on_step_end=None):
  """Pipeline steps [first, first + num_steps) of K (``num_steps`` may be traced) of output tile
  ``n`` into the float32 accumulators ``accs`` ([TILE_N, R], one per weight): each step loads a
  [TILE_N, bk] tile of every weight in ``w_refs`` (one expert's bf16 [K, N] or INT4 words and
  scales) and x_rows' [R, bk] tile, and adds W^T x^T (INT4 dequantised in registers or, for
  "smem", through ``deq_smem``). ``on_step_end(idx)`` runs after each step's products (the
  chunk hooks). Returns the steps that lay inside K (the tile-load count)."""
  r = x_rows.shape[0]
  smem_dequant = is_int4 and int4_dequant == "smem"

  def step(indices, *args):
    (idx,), smem, count = indices, args[:-1], args[-1]
    x_t = smem[-1].T  # [bk, R]
    if not is_int4:
      for acc, w_smem in zip(accs, smem[:-1]):
        plgpu.wgmma(acc, w_smem.T, x_t)  # [TILE_N, bk] @ [bk, R]
    else:
      for i, acc in enumerate(accs):
        words_smem, scale_smem = smem[2 * i], smem[2 * i + 1]
        if smem_dequant:
          deq_smem[i][...] = _dequant_words_jnp(words_smem, scale_smem, bk)
          plgpu.commit_smem()
          plgpu.wgmma(acc, deq_smem[i], x_t)
        else:
          plgpu.wgmma(acc, _dequant_words_registers(words_smem, scale_smem, bk), x_t)
          if int4_dequant == "registers_serial":
            plgpu.wgmma_wait(0)  # fewer live registers: the next weight's tile reuses them
      # The operands (registers, or the one shared-memory tile per weight) must outlive their
      # MMAs; this also lets the x tile go as soon as the step ends.
      plgpu.wgmma_wait(0)
    if on_step_end is not None:
      on_step_end(idx)
    return count + (first + idx < k_steps).astype(jnp.int32)  # steps past K load zeros

  if is_int4:
    in_specs = []
    for _ in range(len(accs)):
      in_specs.append(plgpu.BlockSpec((TILE_N, bk // 8), lambda k: (n, first + k), transforms=WORDS_TRANSFORMS))
      in_specs.append(plgpu.BlockSpec((TILE_N, bk // GROUP_SIZE), lambda k: (n, first + k)))
  else:
    in_specs = [plgpu.BlockSpec((bk, TILE_N), lambda k: (first + k, n),
                                transforms=_bf16_transforms(x_atom), delay_release=1) for _ in accs]
  # bf16's MMAs still read the x tile when the next step starts; INT4's steps drain them.
  in_specs.append(plgpu.BlockSpec((r, bk), lambda k: (0, first + k),
                                  transforms=_bf16_transforms(x_atom), delay_release=0 if is_int4 else 1))
  return plgpu.emit_pipeline(step, grid=(num_steps,), in_specs=in_specs, max_concurrent_steps=stages,
                             init_carry=jnp.int32(0))(*w_refs, x_rows)


def _weight_dims(weights, bk: int):
  """(is_int4, experts E, output features N, the weights' arrays in kernel-argument order, pipeline
  steps over K, the x tile's swizzle atom) of one projection's weights (bf16 [E, K, N] or
  ``KernelInt4Matrix`` [E, N, K]) at ``bk`` input features a step."""
  is_int4 = isinstance(weights[0], KernelInt4Matrix)
  if is_int4:
    if bk % PACK_BLOCK:
      raise ValueError(f"INT4 needs block_k a multiple of {PACK_BLOCK} (the packed layout's block), got {bk}")
    num_experts, n_out, words = weights[0].words.shape
    k_in = weights[0].in_features
    flat_weights = [t for m in weights for t in (m.words, m.scale)]
    # Over the padded K: its words and scales past K are zero, and so is x (zero-filled loads).
    return is_int4, num_experts, n_out, flat_weights, pl.cdiv(words * 8, bk), _swizzle_elems(k_in)
  num_experts, k_in, n_out = weights[0].shape
  atom = _swizzle_elems(k_in, n_out, TILE_N)
  if bk % atom:  # a step's tile must be whole swizzle atoms of the input features
    raise ValueError(f"block_k={bk} must be a multiple of {atom}, the swizzle atom of {k_in} input features")
  return is_int4, num_experts, n_out, list(weights), pl.cdiv(k_in, bk), atom


class KernelWork(NamedTuple):
  """The work list as the gate/up kernel wrote it (``work_list_impl="kernel"``)."""
  expert: jax.Array  # int32[W]: as ``WorkList.expert`` (every slot written, -1 past num_slots)
  num_slots: jax.Array  # int32[1]
  row_column: jax.Array  # int32[A]: as ``WorkList.row_column`` for routed rows; unwritten past them
  num_routed: jax.Array  # int32[1]: rows routed (sum of the counts, at most A)


def _grouped_kernel(x, work_expert, block_start, weights, *, fuse_silu: bool, cfg: TileConfig,
                    block_rows: int, int4_dequant: str, count_tile_loads: bool, interpret,
                    grid_order: str, num_slots=None, item_programs: int | None = None, sizes=None,
                    num_rows: int | None = None, live_first: bool = False, pdl: bool = False):
  """One grouped projection (or the fused gate/up pair) into the work layout.

  Args:
    x: bf16 [rows, K]; work_expert: int32[W] (outside [0, E), e.g. -1: skip the item).
    block_start: int32[W], item w's rows are x[block_start[w] : block_start[w] + R] (rows of
      that block past x's are zero-filled on load); or None: x is in the work layout [W * R, K],
      item w's rows at w * R.
    weights: tuple of bf16 [E, K, N] (one or two of them), or of ``KernelInt4Matrix`` [E, N, K].
    fuse_silu: with two weights, write silu(x @ w0) * (x @ w1).
    num_slots, item_programs: a compact grid (``_visit_items``): ``item_programs`` (static) G < W
      programs along the items, each taking slots g, g + G, ... below ``num_slots`` (int32[1],
      on the device; every slot from there on is -1). With ``live_first`` (per-pair items) the
      count is found in the kernel instead: slot s is the s-th item of ``_live_first``'s order.
    sizes: int32[E], the experts' row counts, in place of ``work_expert``, ``block_start`` and
      ``num_slots`` (all None): each program computes its slots' items (``slot_item``) over
      ``work_list``'s W slots for ``num_rows`` rows (x may hold padding rows past them), and the
      kernel also returns the list as a ``KernelWork`` (written by the programs of output tile
      0) for the kernels after it.
  Returns:
    bf16 [W * R, N]; or, where ``cfg.split_k`` and K has more than one chunk, the chunks'
    float32 sums [C, len(weights), W, ceil(N / 64) * 64, R] (item w's chunk c of weight i at
    [c, i, w], features by rows as the MMA makes them, unused past N; not through SiLU:
    ``_fold_kernel`` or ``_work_rows`` adds them). Plus, when ``count_tile_loads``, int32 [ceil(N / 64), W]: pipeline steps inside K
    (each loading one tile of every weight) per (output tile, item), summed over chunk programs;
    0 where the item is skipped.
  """
  r, bk = block_rows, cfg.block_k
  in_kernel_list = sizes is not None
  if in_kernel_list:
    if work_expert is not None or block_start is not None or num_slots is not None:
      raise ValueError("sizes replaces work_expert, block_start and num_slots")
    w_items = max_work_items(sizes.shape[0], num_rows, r)
    last_window = padded_rows(num_rows, r) - r
    if last_window + r > x.shape[0]:
      raise ValueError(f"x has {x.shape[0]} rows; the R-row windows need {last_window + r} (pad x first)")
  else:
    w_items = work_expert.shape[0]
  direct = block_start is not None or in_kernel_list
  num_w = len(weights)
  is_int4, num_experts, n_out, flat_weights, k_steps, x_atom = _weight_dims(weights, bk)
  smem_dequant = is_int4 and int4_dequant == "smem"
  n_tiles = pl.cdiv(n_out, TILE_N)
  out_atom = _swizzle_elems(n_out, TILE_N)
  chunk_steps = k_steps if cfg.chunk_k is None else cfg.chunk_k // bk
  chunks = pl.cdiv(k_steps, chunk_steps)
  split = cfg.split_k and chunks > 1
  fold = chunks > 1 and not split  # one program adds its chunks' sums
  # INT4 steps drain their MMAs anyway, so it adds each chunk's sums inside its one pipeline into
  # shared memory; bf16 keeps its MMAs in flight across steps, which an accumulator read in the
  # step would stop, so it runs a pipeline per chunk (H200: the in-step form cost bf16 2%, the
  # per-chunk form cost INT4 25-40%: its two-deep ring refills at every chunk). Interpret mode
  # cannot store to an accumulator: always the per-chunk form there.
  fold_in_step = fold and is_int4 and interpret is None
  program_steps = chunk_steps if split else k_steps
  acc_bytes = TILE_N * r * 4
  fixed_smem = (num_w * acc_bytes if (split or fold_in_step) else 0) + (0 if split else r * TILE_N * 2)
  stages = _fit_stages(cfg, num_w, is_int4, smem_dequant, r, fixed_smem)
  compact = _compact(w_items, num_slots, item_programs, in_kernel_list or live_first)
  if live_first and (in_kernel_list or num_slots is not None):
    raise ValueError("live_first finds the live items itself: it takes neither sizes nor num_slots")
  pipe = dict(is_int4=is_int4, bk=bk, k_steps=k_steps, x_atom=x_atom, stages=stages, int4_dequant=int4_dequant)

  def body(*refs):
    pdl_prologue(pdl, interpret)
    if in_kernel_list:
      sizes_ref, *refs = refs
    else:
      expert_ref, *refs = refs
      if compact and not live_first:
        slots_ref, *refs = refs
      if direct:
        start_ref, *refs = refs
    x_ref, *refs = refs
    w_refs = refs[:len(flat_weights)]
    out_ref, *refs = refs[len(flat_weights):]
    if count_tile_loads:
      count_ref, *refs = refs
    else:
      count_ref = None
    if in_kernel_list:
      list_expert_ref, list_slots_ref, list_rows_ref, list_routed_ref, *refs = refs
    scratch = refs
    if split:  # one [TILE_N, R] float32 tile per weight for its chunk's sums
      part_smem, deq_smem = scratch[:num_w], scratch[num_w:]
    elif fold_in_step:  # one [TILE_N, R] float32 running sum per weight, and the output tile
      run_smem, (out_smem, *deq_smem) = scratch[:num_w], scratch[num_w:]
    else:
      out_smem, *deq_smem = scratch
    n = lax.axis_index("n")
    c = lax.axis_index("c") if split else 0
    first_step = c * chunk_steps
    count_at = lambda w: (c, n, w) if split else (n, w)
    writes_list = (n == 0) & (c == 0)  # one program per slot writes the list's entries

    def skip(w):
      if count_tile_loads:
        count_ref[count_at(w)] = jnp.int32(0)
      if in_kernel_list:
        @pl.when(writes_list)
        def _():
          list_expert_ref[w] = jnp.int32(-1)

    def lookup(w, slot):
      """(expert, the first row of its R-row block of x) of slot w (``slot``: its ``SlotItem``)."""
      if not in_kernel_list:
        return expert_ref[w], (start_ref[w] if direct else None)

      @pl.when(writes_list)
      def _():
        list_expert_ref[w] = slot.expert
        # Each routed row's place in the work layout, written by the one item that holds it.
        def place(i, carry):
          row = slot.first_row + i
          list_rows_ref[row] = w * r + row - slot.block_start
          return carry
        lax.fori_loop(0, jnp.minimum(slot.num_rows, num_rows - slot.first_row), place, jnp.int32(0))
      return slot.expert, slot.block_start

    def item(w, slot=None):
      expert, block_first_row = lookup(w, slot)
      live = (expert >= 0) & (expert < num_experts)

      pl.when(~live)(lambda: skip(w))

      @pl.when(live)
      def _():
        def pipeline(accs, first, num_steps, fold_chunks):
          """Runs steps [first, first + num_steps) of K into ``accs``; returns the steps inside K.
          With ``fold_chunks`` each chunk's sums are added to ``run_smem`` and the MMAs restart
          from zero, the loads staying in flight across chunks."""
          def chunk_end(idx):
            @pl.when((idx % chunk_steps == chunk_steps - 1) | (idx == num_steps - 1))
            def _():
              for acc, run in zip(accs, run_smem):
                run[...] = run[...] + acc[...]
                acc[...] = jnp.zeros((TILE_N, r), jnp.float32)

          start = pl.multiple_of(block_first_row, ROW_ALIGN) if direct else w * r
          return _k_pipeline(accs, [ref.at[expert] for ref in w_refs], x_ref.at[pl.ds(start, r)], n=n,
                             first=first, num_steps=num_steps, on_step_end=chunk_end if fold_chunks else None,
                             deq_smem=deq_smem, **pipe)

        def chunk_sums(first, num_steps):
          def scope(*accs):
            steps = pipeline(accs, first, num_steps, fold_chunks=False)
            return steps, tuple(acc[...] for acc in accs)
          return pl.run_scoped(scope, *[plgpu.ACC((TILE_N, r)) for _ in range(num_w)])

        if not fold:
          steps, sums = chunk_sums(first_step, program_steps)
        elif fold_in_step:
          def scope(*accs):
            for run in run_smem:
              run[...] = jnp.zeros((TILE_N, r), jnp.float32)
            return pipeline(accs, 0, k_steps, fold_chunks=True)
          steps = pl.run_scoped(scope, *[plgpu.ACC((TILE_N, r)) for _ in range(num_w)])
          sums = tuple(run[...] for run in run_smem)
        else:  # a pipeline (and accumulator) per chunk: the same sums, added in the same order
          steps, sums = jnp.int32(0), [jnp.zeros((TILE_N, r), jnp.float32)] * num_w
          for chunk in range(chunks):
            first = chunk * chunk_steps
            chunk_steps_run, parts = chunk_sums(first, min(chunk_steps, k_steps - first))
            steps, sums = steps + chunk_steps_run, [s + p for s, p in zip(sums, parts)]
        if count_tile_loads:
          count_ref[count_at(w)] = steps
        if split:
          for i, (part, tile) in enumerate(zip(sums, part_smem)):
            tile[...] = part  # [TILE_N, R], as the MMA made it (Mosaic GPU has no transposed f32 store)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, out_ref.at[c, i, w, pl.ds(n * TILE_N, TILE_N)])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          return
        result = _silu_mul(*sums) if fuse_silu else sums[0]
        out_smem.T[...] = result.astype(jnp.bfloat16)  # [TILE_N, R] into [R, TILE_N]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(w * r, r), pl.ds(n * TILE_N, TILE_N)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if in_kernel_list:
      g = lax.axis_index("w")
      find = functools.partial(slot_item, sizes_ref, block_rows=r, last_window=last_window, num_rows=num_rows)
      first, total_slots, total_rows = find(g)  # the pass for the program's first slot gives the totals

      @pl.when(writes_list & (g == 0))
      def _():
        list_slots_ref[0] = total_slots
        list_routed_ref[0] = jnp.minimum(total_rows, num_rows)
      if compact:
        _visit_items(lambda w: item(w, find(w)[0]), skip, w_items, item_programs, total_slots,
                     first=lambda: item(g, first))
      else:
        item(g, first)
    elif live_first and compact:
      live, item_of = _live_first(expert_ref, w_items, num_experts)
      _visit_items(lambda slot: item(item_of(slot)), lambda slot: skip(item_of(slot)), w_items, item_programs, live)
    else:
      _visit_items(item, skip, w_items, item_programs, slots_ref[0] if compact else None)

  if split:
    # Whole output tiles (the features past N never read): a [TILE_N, R] chunk-sum tile is a
    # contiguous, unswizzled slice, which Mosaic GPU stores by a plain bulk copy clamped only at
    # the array's end, so a tile running past N would write into the next item's features
    # (interpret mode clips it per dimension).
    out_types = [jax.ShapeDtypeStruct((chunks, num_w, w_items, n_tiles * TILE_N, r), jnp.float32)]
    scratch = [plgpu.SMEM((TILE_N, r), jnp.float32) for _ in range(num_w)]
  else:
    out_types = [jax.ShapeDtypeStruct((w_items * r, n_out), jnp.bfloat16)]
    scratch = [plgpu.SMEM((TILE_N, r), jnp.float32) for _ in range(num_w)] if fold_in_step else []
    scratch.append(plgpu.SMEM((r, TILE_N), jnp.bfloat16, transforms=_bf16_transforms(out_atom)))
  if count_tile_loads:
    out_types.append(jax.ShapeDtypeStruct(((chunks,) if split else ()) + (n_tiles, w_items), jnp.int32))
  if in_kernel_list:
    out_types += [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((w_items,), (1,), (num_rows,), (1,))]
  if smem_dequant:
    scratch += [plgpu.SMEM((TILE_N, bk), jnp.bfloat16, transforms=_bf16_transforms(x_atom))
                for _ in range(num_w)]
  item_axis = item_programs if compact else w_items
  grid, names = ((n_tiles, item_axis), ("n", "w")) if grid_order == "item_minor" else ((item_axis, n_tiles), ("w", "n"))
  if split:  # a chunk's programs of one (item, tile) launch together
    grid, names = grid + (chunks,), names + ("c",)
  kernel = plgpu.kernel(
      body, out_type=tuple(out_types), grid=grid, grid_names=names,
      kernel_name="moe_gate_up" if fuse_silu else "moe_down",  # named in profiles (CUPTI, ncu)
      scratch_types=scratch, interpret=interpret,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  if in_kernel_list:
    outs = kernel(sizes.astype(jnp.int32), x, *flat_weights)
    outs, work = outs[:-4], KernelWork(*outs[-4:])
  else:
    outs = kernel(work_expert, *((num_slots,) if compact and not live_first else ()),
                  *((block_start,) if direct else ()), x, *flat_weights)
    work = None
  if count_tile_loads:
    out, loads = outs
    result = out, (loads.sum(axis=0) if split else loads)
  else:
    result = outs[0]
  return (result, work) if in_kernel_list else result


def _compact(w_items: int, num_slots, item_programs, counted_in_kernel: bool = False) -> bool:
  if item_programs is None or item_programs >= w_items:
    return False
  if (num_slots is None and not counted_in_kernel) or item_programs < 1:
    raise ValueError(f"item_programs={item_programs} needs num_slots and must be >= 1")
  return True


# Per-pair items on a compact grid find their live items by an unrolled pass over all W items in
# every program; past this many the pass would outgrow the prologue (and the sorted work list is
# the better path anyway).
LIVE_FIRST_MAX_ITEMS = 16


# Per-pair items where fewer pairs are expected live than there are (an expert-parallel share): a
# program per expected live pair, at least 2. Measured on the H200 (``results/moe_per_row_grid.md``,
# one token's 8 pairs, GPU us a call, each grid against a program per pair in the same run, rows bit
# for bit alike): the 48-expert share (1 expected live pair) with G = 2: bf16 22.6 against 26.2
# (0.86x), INT4 15.5 against 17.8 (0.87x); G = 1, 3 and 4 gained less (bf16 G = 3 and 4 moved by
# 4-9% between two runs, G = 2 by 1%). The 96-expert share (2 expected): G = 2 bf16 0.97x, INT4 0.97x
# (G = 3: 1.02x and 0.95x).
PAIR_PROGRAMS_MIN = 2


def default_pair_programs(pairs: int, expected_rows: int | None) -> int | None:
  """Programs along per-pair items (``item_programs`` of ``moe_experts_per_row``): None (a program
  per pair) unless ``expected_rows`` (the pairs expected to be routed to these experts) is below
  ``pairs``; then a compact grid of a program per expected live pair (at least
  ``PAIR_PROGRAMS_MIN``), None again where that is no fewer than the pairs or there are
  more than ``LIVE_FIRST_MAX_ITEMS`` pairs. The dead pairs then launch no programs of their own, and
  a step with more live pairs than programs runs them in a second round (same rows)."""
  if expected_rows is None or expected_rows >= pairs or pairs > LIVE_FIRST_MAX_ITEMS:
    return None
  programs = max(PAIR_PROGRAMS_MIN, expected_rows)
  return programs if programs < pairs else None


def _live_first(expert_ref, w_items: int, num_experts: int):
  """(live items: int32 scalar, slot -> item): per-pair items in the order live ones (expert in
  [0, E)) by index, then the others by index, so that a compact grid's first slots are the live
  items and its later ones each dead item once (``skip`` zeroes their tile-load counts). One
  unrolled scalar pass over the W ids for the count, one per slot for its item."""
  live = []
  for w in range(w_items):
    expert = expert_ref[w]
    live.append(((expert >= 0) & (expert < num_experts)).astype(jnp.int32))
  count = functools.reduce(lambda a, b: a + b, live)

  def item_of(slot):
    item, live_rank, dead_rank = jnp.int32(0), jnp.int32(0), count
    for w, is_live in enumerate(live):
      rank = jnp.where(is_live > 0, live_rank, dead_rank)
      item = jnp.where(rank == slot, jnp.int32(w), item)
      live_rank, dead_rank = live_rank + is_live, dead_rank + 1 - is_live
    return item
  return count, item_of


def _visit_items(item, skip, w_items: int, item_programs, num_slots, first=None):
  """Runs ``item(w)`` for this program's work item slots: the grid's "w" index; or, on a compact
  grid (``num_slots`` given: an int32 scalar), slots w = g, g + G, ... (G = ``item_programs``)
  below ``num_slots``, and ``skip(w)`` for this program's slots past it; ``first()``, where given,
  in place of ``item(g)`` (its item found already).

  Why: the work list's length is a static bound, far above the live items where few experts are
  touched (73 slots for ~8 live items at 48 experts and T = 9). A program per slot costs every
  dead slot a launch, and dead programs beside live ones slowed the 4-programs-an-SM INT4 form by
  up to 14 us (``moe_dead_tail.md``). Sized by the expected items, the grid holds about the live
  programs; a step with more items than G runs them in a second round, as a second wave would."""
  g = lax.axis_index("w")
  if num_slots is None:
    item(g)
    return
  slots = jnp.minimum(num_slots, w_items)

  def visit(i, carry):
    w = g + i * item_programs
    pl.when(w < slots)(lambda: item(w))
    pl.when((w >= slots) & (w < w_items))(lambda: skip(w))
    return carry

  start = 0
  if first is not None:  # slot g (< G < W) first
    pl.when(g < slots)(first)
    pl.when(g >= slots)(lambda: skip(g))
    start = 1
  lax.fori_loop(start, pl.cdiv(w_items, item_programs), visit, jnp.int32(0))


def _fold_kernel(partials, work_expert, *, n_out: int, num_experts: int, fuse_silu: bool, interpret, num_slots=None,
                 item_programs: int | None = None, live_first: bool = False, pdl: bool = False):
  """Adds ``_grouped_kernel``'s chunk sums in chunk order, ((0 + c0) + c1) + ..., as its unsplit
  programs do, then SiLU(gate) * up (or takes the one weight's sum): f32 [C, num_w, W, N', R] (N'
  = N in whole output tiles) -> bf16 [W * R, N] in the work layout; items outside [0, E) are
  skipped, their rows unwritten. ``num_slots``, ``item_programs``, ``live_first``: a compact grid, as
  ``_grouped_kernel``'s."""
  chunks, num_w, w_items, n_padded, r = partials.shape
  if n_padded != pl.cdiv(n_out, TILE_N) * TILE_N:
    raise ValueError(f"partials hold {n_padded} features, not N = {n_out} in whole tiles of {TILE_N}")
  if chunks * num_w * r * TILE_N * 4 + r * TILE_N * 2 > SMEM_BUDGET:
    raise ValueError(f"split_k with block_rows={r} and {chunks} chunks does not fit shared memory; "
                     "use fewer rows per work item or split_k=False")
  out_atom = _swizzle_elems(n_out, TILE_N)
  compact = _compact(w_items, num_slots, item_programs, live_first)

  def body(expert_ref, *refs):
    pdl_prologue(pdl, interpret)
    if compact and not live_first:
      slots_ref, *refs = refs
    part_ref, out_ref, part_smem, out_smem, barrier = refs
    n = lax.axis_index("n")

    def item(w):
      expert = expert_ref[w]

      @pl.when((expert >= 0) & (expert < num_experts))
      def _():
        for c in range(chunks):  # the bulk copy engine takes at most 5 strided dimensions a copy
          plgpu.copy_gmem_to_smem(part_ref.at[c, :, w, pl.ds(n * TILE_N, TILE_N)], part_smem.at[c], barrier)
        plgpu.barrier_wait(barrier)
        sums = []
        for i in range(num_w):
          total = jnp.zeros((TILE_N, r), jnp.float32)
          for c in range(chunks):
            total = total + plgpu.layout_cast(part_smem[c, i], plgpu.Layout.WGMMA)
          sums.append(total)
        result = _silu_mul(*sums) if fuse_silu else sums[0]
        out_smem.T[...] = result.astype(jnp.bfloat16)  # [TILE_N, R] into [R, TILE_N], as the unsplit kernel
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(w * r, r), pl.ds(n * TILE_N, TILE_N)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if live_first and compact:
      live, item_of = _live_first(expert_ref, w_items, num_experts)
      _visit_items(lambda slot: item(item_of(slot)), lambda slot: None, w_items, item_programs, live)
    else:
      _visit_items(item, lambda w: None, w_items, item_programs, slots_ref[0] if compact else None)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((w_items * r, n_out), jnp.bfloat16),
      grid=(item_programs if compact else w_items, pl.cdiv(n_out, TILE_N)), grid_names=("w", "n"),
      kernel_name="moe_fold",
      scratch_types=[plgpu.SMEM((chunks, num_w, TILE_N, r), jnp.float32),
                     plgpu.SMEM((r, TILE_N), jnp.bfloat16, transforms=_bf16_transforms(out_atom)),
                     plgpu.Barrier(num_arrivals=chunks)],
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(work_expert, *((num_slots,) if compact and not live_first else ()), partials)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------
def _check_inputs(x_sorted, group_sizes, experts):
  if x_sorted.ndim != 2:
    raise ValueError(f"x_sorted must be [A, H], got shape {x_sorted.shape}")
  if x_sorted.dtype != jnp.bfloat16:
    raise TypeError(f"the Mosaic GPU MoE kernel takes bfloat16 activations, got {x_sorted.dtype} "
                    "(run the model in bf16 or use moe_impl='xla')")
  if group_sizes is not None and (group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
    raise ValueError(f"group_sizes must be an integer vector [E], got {group_sizes.dtype}{list(group_sizes.shape)}")
  a, h = x_sorted.shape
  if isinstance(experts, Int4Experts) and isinstance(experts.gate, KernelInt4Matrix):
    mats = (experts.gate, experts.up, experts.down)
    for name, m in zip(("gate", "up", "down"), mats):
      if not isinstance(m, KernelInt4Matrix):
        raise TypeError(f"Int4 {name}: mixes layouts (gate is KernelInt4Matrix, {name} is {type(m).__name__})")
      if m.words.dtype != jnp.uint32 or m.scale.dtype != jnp.bfloat16:
        raise TypeError(f"Int4 {name}: words must be uint32 and scale bfloat16, got {m.words.dtype}, {m.scale.dtype}")
      en, n, words = m.words.shape
      if words % (PACK_BLOCK // 8) or m.scale.shape != (en, n, words * 8 // GROUP_SIZE) or words * 8 < m.in_features:
        raise ValueError(f"Int4 {name}: words {list(m.words.shape)} / scale {list(m.scale.shape)} are not "
                         f"[E, N, Kp/8] / [E, N, Kp/32] with Kp a multiple of {PACK_BLOCK} >= K={m.in_features}")
    shapes = [(m.num_experts, m.in_features, m.out_features) for m in mats]
  elif isinstance(experts, Int4Experts):
    raise TypeError(f"INT4 experts must be in the kernel's layout (KernelInt4Matrix), got "
                    f"{type(experts.gate).__name__}: convert once with models.int4.kernel_experts")
  else:
    if not isinstance(experts, Bf16Experts):
      raise TypeError(f"experts must be Bf16Experts(gate, up, down) or Int4Experts, got {type(experts).__name__}")
    for name, t in zip(("gate", "up", "down"), experts):
      if t.ndim != 3 or t.dtype != jnp.bfloat16:
        raise TypeError(f"bf16 expert weight {name} must be bfloat16 [E, in, out], got {t.dtype}{list(t.shape)}")
    shapes = [tuple(t.shape) for t in experts]
  (eg, hg, ig), (eu, hu, iu), (ed, id_, hd) = shapes
  e = eg if group_sizes is None else group_sizes.shape[0]
  if not (eg == eu == ed == e) or not (hg == hu == hd == h) or not (ig == iu == id_):
    raise ValueError(f"expert shapes gate {shapes[0]}, up {shapes[1]}, down {shapes[2]} (as E, in, out) do "
                     f"not match x_sorted [A={a}, H={h}] and group_sizes [E={e}]")
  if h % 16 or ig % 16:
    raise ValueError(f"hidden {h} and intermediate {ig} sizes must be multiples of 16 (the smallest bf16 "
                     "swizzle atom of the shared-memory tiles)")
  return a, h, ig, e


# With draining after each weight the INT4 gate/up kernel needs 114 registers a thread (4 programs
# an SM) against 194 (2 an SM) when both weights' MMAs are in flight (ptxas, H200). Where the
# "registers" form would need a second wave (more than 2 programs an SM), the occupancy pays; with
# fewer programs each one's serial chain is all there is. At the 48-expert share, with the work
# list in the gate/up kernel and its compact grid (one H200 run, 2026-11-30, ``moe_dequant_form.md``;
# GPU us a call, registers vs serial): T = 5 (~150 programs expected) 55.4 vs 56.7, T = 9 (~265)
# 87.8 vs 83.5, T = 13 107.7 vs 107.4, T = 17 127.6 vs 123.9, T = 33 205.5 vs 198.3, T = 65 287.8
# vs 279.0, T = 136 370.4 vs 356.5. (4 an SM until then, from an earlier kernel that ran T = 17 at
# 187 us serial against 182.)
SERIAL_PROGRAMS_PER_SM = 2


def default_int4_dequant(num_experts: int, expected_rows: int, inter: int) -> str:
  """'registers_serial' where the gate/up grid is expected to hold >= ``SERIAL_PROGRAMS_PER_SM``
  live programs per SM."""
  programs = expected_touched(num_experts, expected_rows) * pl.cdiv(inter, TILE_N)
  return "registers_serial" if programs >= SERIAL_PROGRAMS_PER_SM * num_sms() else "registers"


def _resolve_options(a: int, e: int, inter: int, block_rows, int4_dequant, expected_rows, interpret, *,
                     is_int4: bool):
  if a < 1:
    raise ValueError("x_sorted has no rows")
  rows = a if expected_rows is None else expected_rows
  if not isinstance(rows, int) or rows < 1:
    raise ValueError(f"expected_rows={expected_rows!r} must be a positive int")
  r = block_rows or default_block_rows(e, rows, is_int4=is_int4)
  fmt = "int4" if is_int4 else "bf16"
  if r % MIN_BLOCK_ROWS or not MIN_BLOCK_ROWS <= r <= MAX_BLOCK_ROWS[fmt]:
    raise ValueError(f"block_rows={r} must be a multiple of {MIN_BLOCK_ROWS} in [16, {MAX_BLOCK_ROWS[fmt]}] "
                     f"for {fmt} experts")
  # The register form is inline PTX for the real GPU; interpret mode (or any non-GPU backend, e.g.
  # under plgpu.force_gpu_interpret_mode) runs the plain-jnp shared-memory form.
  on_gpu = interpret is None and jax.default_backend() == "gpu"
  dequant = int4_dequant or (default_int4_dequant(e, rows, inter) if on_gpu else "smem")
  if dequant not in ("registers", "registers_serial", "smem"):
    raise ValueError(f"int4_dequant={int4_dequant!r}: expected 'registers', 'registers_serial' or 'smem'")
  if dequant == "smem" and on_gpu:
    raise ValueError("int4_dequant='smem' is interpret mode's plain-jnp form; it does not lower for the GPU")
  if dequant != "smem" and interpret is not None:
    raise ValueError(f"int4_dequant={dequant!r} is inline PTX for the GPU; interpret mode runs 'smem'")
  return r, dequant


def _row_experts(group_sizes, num_rows: int):
  """int32[A]: each sorted row's expert from the counts (E past their sum): the experts whose
  rows end at or before the row, by masked sums (one small fusion each; no cumsum kernel)."""
  e = group_sizes.shape[0]
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  experts = jnp.arange(e, dtype=jnp.int32)
  row_end = jnp.sum(jnp.where(experts[None, :] <= experts[:, None], sizes[None, :], 0), axis=1)  # [E]
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  return jnp.sum(row_end[None, :] <= rows[:, None], axis=1, dtype=jnp.int32)


def _num_experts(experts) -> int:
  return (experts.gate.words if isinstance(experts.gate, KernelInt4Matrix) else experts.gate).shape[0]


def _check_row_ids(sorted_expert_ids, num_rows: int):
  if (sorted_expert_ids.shape != (num_rows,)
      or not jnp.issubdtype(sorted_expert_ids.dtype, jnp.integer)):
    raise ValueError(f"sorted_expert_ids must be an integer vector [A={num_rows}] (each sorted row's "
                     f"expert), got {sorted_expert_ids.dtype}{list(sorted_expert_ids.shape)}")


def _check_item_programs(item_programs):
  if item_programs is not None and (isinstance(item_programs, bool) or not isinstance(item_programs, int)
                                    or item_programs < 1):
    raise ValueError(f"item_programs={item_programs!r} must be a positive int (programs along the work items)")


def _per_row(tokens, expert_ids, experts, block_rows, dequant, tiles, interpret, count_tile_loads,
             item_programs=None, expected_rows=None):
  """Per-pair items (``PER_ROW_MAX_ROWS``): bf16 tokens [M, H], int expert_ids [M, K] ->
  bf16 [M, K, H], zero where the id is outside [0, E). ``item_programs`` G below the M x K pairs:
  a compact grid whose G programs along the items take the live pairs first (``_live_first``);
  None: ``default_pair_programs(M x K, expected_rows)``."""
  m, k = expert_ids.shape
  e = _num_experts(experts)
  _check_item_programs(item_programs)
  if item_programs is None:
    item_programs = default_pair_programs(m * k, expected_rows)
  block_start, position = per_row_layout(m, k, block_rows)
  ids = expert_ids.reshape(-1).astype(jnp.int32)
  live_first = item_programs is not None and item_programs < ids.size
  if live_first and ids.size > LIVE_FIRST_MAX_ITEMS:
    raise ValueError(f"item_programs={item_programs} below the {ids.size} pairs: a compact grid over per-pair "
                     f"items takes at most {LIVE_FIRST_MAX_ITEMS} pairs (leave item_programs unset)")
  outs = _expert_projections(tokens, ids, jnp.asarray(block_start), experts, block_rows, dequant, tiles, interpret,
                             count_tile_loads, item_programs=item_programs if live_first else None,
                             live_first=live_first)
  out = outs[0] if count_tile_loads else outs
  live = ((ids >= 0) & (ids < e))[:, None]
  y = jnp.where(live, _work_rows(out, jnp.asarray(position), tokens.shape[1]), jnp.zeros((), jnp.bfloat16))
  y = y.reshape(m, k, -1)
  return (y, *outs[1:]) if count_tile_loads else y


def _work(group_sizes, sorted_expert_ids, num_rows: int, block_rows: int) -> WorkList:
  """The work list from the row ids (checked by the caller) where given and there are no more rows
  than experts (the [A, A] form is then the smaller), else from group_sizes (with the ids, if given,
  for the rows' columns); for ids consistent with group_sizes all give the same list."""
  e = group_sizes.shape[0]
  if sorted_expert_ids is None:
    return work_list(group_sizes, num_rows, block_rows)
  # Where A <= E the ids alone decide the list (group_sizes gives only E); the caller keeps them
  # consistent with group_sizes. Past it the counts make the items and the ids the rows' columns.
  if num_rows <= e:
    return work_list_from_rows(sorted_expert_ids, e, block_rows)
  return work_list(group_sizes, num_rows, block_rows, sorted_expert_ids)


WORK_LIST_IMPLS = ("kernel", "jnp")


def default_work_list_impl(num_experts: int) -> str:
  """"kernel" (the gate/up kernel builds the list from the counts) up to
  ``KERNEL_WORK_LIST_MAX_EXPERTS`` experts, else "jnp" (``work_list``, or ``work_list_from_rows``
  where the row ids are given and A <= E)."""
  return "kernel" if num_experts <= KERNEL_WORK_LIST_MAX_EXPERTS else "jnp"


def _moe_experts(x_sorted, group_sizes, experts, block_rows, int4_dequant, expected_rows, tiles, interpret,
                 count_tile_loads, sorted_expert_ids=None, per_row=None, item_programs=None, work_list_impl=None):
  interpret = interpret_params(interpret)
  a, _, inter, e = _check_inputs(x_sorted, group_sizes, experts)
  r, dequant = _resolve_options(a, e, inter, block_rows, int4_dequant, expected_rows, interpret,
                                is_int4=isinstance(experts, Int4Experts))
  tiles = tiles or default_tiles(experts, a if expected_rows is None else expected_rows, r)
  if per_row is not None and not isinstance(per_row, bool):
    raise ValueError(f"per_row={per_row!r}: expected None (auto), True or False")
  if per_row is None:
    per_row = a <= PER_ROW_MAX_ROWS
  if per_row:
    if sorted_expert_ids is None:
      sorted_expert_ids = _row_experts(group_sizes, a)
    _check_row_ids(sorted_expert_ids, a)
    outs = _per_row(x_sorted, sorted_expert_ids.reshape(a, 1), experts, r, dequant, tiles, interpret,
                    count_tile_loads, item_programs, expected_rows)
    if count_tile_loads:
      return (outs[0][:, 0], *outs[1:])
    return outs[:, 0]
  impl = work_list_impl or default_work_list_impl(e)
  if impl not in WORK_LIST_IMPLS:
    raise ValueError(f"work_list_impl={work_list_impl!r}: expected one of {WORK_LIST_IMPLS}")
  if impl == "kernel" and e > KERNEL_WORK_LIST_MAX_EXPERTS:
    raise ValueError(f"work_list_impl='kernel' takes at most {KERNEL_WORK_LIST_MAX_EXPERTS} experts, got {e}")
  if sorted_expert_ids is not None:
    _check_row_ids(sorted_expert_ids, a)
  if padded_rows(a, r) > a:  # the kernel loads R-row blocks at 8-aligned starts
    x_sorted = jnp.pad(x_sorted, ((0, padded_rows(a, r) - a), (0, 0)))
  w_items = max_work_items(e, a, r)
  if item_programs is None:
    item_programs = default_item_programs(e, a if expected_rows is None else expected_rows, w_items, impl)
  _check_item_programs(item_programs)
  if impl == "kernel":
    outs, kernel_work = _expert_projections(x_sorted, None, None, experts, r, dequant, tiles, interpret,
                                            count_tile_loads, None, item_programs, sizes=group_sizes, num_rows=a)
    row_column, routed = kernel_work.row_column, jnp.arange(a) < kernel_work.num_routed[0]
  else:
    work = _work(group_sizes, sorted_expert_ids, a, r)
    outs = _expert_projections(x_sorted, work.expert, work.block_start, experts, r, dequant, tiles, interpret,
                               count_tile_loads, work.num_slots, item_programs)
    row_column, routed = work.row_column, work.routed
  out = outs[0] if count_tile_loads else outs
  # Back from the work layout to sorted rows; rows past sum(group_sizes) are zero (the kernel's
  # list leaves their columns unwritten: clipped, then selected away).
  y = _work_rows(out, jnp.clip(row_column, 0, w_items * r - 1), x_sorted.shape[1])
  y = jnp.where(routed[:, None], y, jnp.zeros((), y.dtype)).astype(jnp.bfloat16)
  return (y, *outs[1:]) if count_tile_loads else y


STATIC_OPTIONS = ("block_rows", "int4_dequant", "expected_rows", "tiles", "interpret")


@functools.partial(jax.jit, static_argnames=STATIC_OPTIONS + ("per_row", "item_programs", "work_list_impl"))
def moe_experts(x_sorted, group_sizes, experts, *, block_rows: int | None = None,
                int4_dequant: str | None = None, expected_rows: int | None = None,
                tiles: KernelTiles | None = None, interpret=None, sorted_expert_ids=None,
                per_row: bool | None = None, item_programs: int | None = None,
                work_list_impl: str | None = None):
  """Routed-expert SwiGLU over expert-sorted rows, reading only the touched experts' weights.

  Args:
    x_sorted: bf16 [A, H] rows grouped by expert in expert order. Rows past sum(group_sizes)
      (padding) may share a loaded block with routed rows but never change their results, even
      when they hold NaN.
    group_sizes: int[E] rows per expert. A negative count is taken as 0, and the groups are cut
      at row A where they sum past it (the rows they would have past A do not exist).
    experts: ``Bf16Experts`` (gate, up [E, H, I]; down [E, I, H]) or ``Int4Experts`` of
      ``KernelInt4Matrix`` (``models.int4.kernel_experts`` converts K2.6's layout once).
    block_rows: rows per work item (static; default ``default_block_rows(E, expected_rows, is_int4=...)``: up to
      128 for bf16, 64 for INT4).
    int4_dequant: "registers": each step's tile is dequantised by inline PTX straight into the
      MMA's A-operand registers, every weight's MMAs issued before one drain; "registers_serial":
      the same, draining after each weight (114 registers a thread instead of 194: twice the
      programs per SM); "smem": the plain-jnp form staged through shared memory (interpret
      mode's default: it cannot run inline PTX). GPU default: ``default_int4_dequant``.
    expected_rows: rows expected to be routed to these experts (static; default A). Under expert
      parallelism, where most of A is other devices' padding, pass the local share (about
      A x E / all experts): it sets the defaults of ``block_rows``, ``int4_dequant`` and ``tiles``.
    tiles: ``KernelTiles`` (static); default ``default_tiles(experts, expected_rows, block_rows)``
      (tuned on the H200).
    interpret: None on the GPU, or ``plgpu.InterpretGPUParams(...)`` to run on the CPU.
    sorted_expert_ids: optional int[A], each sorted row's expert in ascending order (E or more
      for padding rows), consistent with ``group_sizes``. Where A <= E and the list is built in
      jnp (``work_list_impl``) it is then built from them alone (``work_list_from_rows``: [A, A] sums instead of [E, E]; the same
      list, so the same result; ids out of order give zeros, except with per-row items, which
      take each row's id as it is); where A > E with the jnp list they give each row's place in
      the work layout by a gather instead of an [A, E] pass (ids that disagree with
      ``group_sizes`` give zeros); with the list built in the kernel they are not used. The
      model passes them; on the H200 the INT4 layer takes 0.92x the GPU time of the group_sizes
      form at 384 experts and T = 1 and 9 (``benchmarks/results/bench_moe_rows.md``).
    per_row: each row its own work item (``moe_experts_per_row``: no work list, no padded copy
      of the rows), its expert from ``sorted_expert_ids`` or else from ``group_sizes``; None
      (default): where A <= ``PER_ROW_MAX_ROWS``. The same rows bit for bit either way.
    item_programs: programs along the work items (static). The sorted path's (default
      ``default_item_programs``): each takes item slots g, g + G, ... up to the work list's
      ``num_slots`` (``_visit_items``). With per-row items, as ``moe_experts_per_row``'s (default
      ``default_pair_programs``: one program per row unless ``expected_rows`` is below the rows).
      The same rows bit for bit whatever it is.
    work_list_impl: who builds the sorted path's work list (static). "kernel": the gate/up
      kernel, each program its own slots' items from ``group_sizes`` (``slot_item``), writing
      the list for the down kernel and the rows' take: no plain-jnp kernels before the first
      MoE kernel (at most ``KERNEL_WORK_LIST_MAX_EXPERTS`` experts); "jnp": ``work_list``, a
      few small XLA kernels; None: ``default_work_list_impl``. The same list, so the same rows
      bit for bit.
  Returns:
    bf16 [A, H]; zero for rows past sum(group_sizes).
  """
  return forward_only("moe_experts", lambda x, w: _moe_experts(
      x, group_sizes, w, block_rows, int4_dequant, expected_rows, tiles, interpret, False, sorted_expert_ids,
      per_row, item_programs, work_list_impl), x_sorted, experts)


@functools.partial(jax.jit, static_argnames=STATIC_OPTIONS + ("item_programs",))
def moe_experts_per_row(tokens, expert_ids, experts, *, block_rows: int | None = None,
                        int4_dequant: str | None = None, expected_rows: int | None = None,
                        tiles: KernelTiles | None = None, interpret=None, item_programs: int | None = None):
  """Each token through each of its experts, one work item per (token, slot): no sort, no work list.

  For a single token's top-k (``PER_ROW_MAX_ROWS``; the model's MoE at one token a step): its
  experts are distinct, so each is read once, and the step skips ``moe_experts``' sort, work
  list and padded copy of the rows. Pairs that share an expert read it once each (correct, not
  economical: use ``moe_experts`` for more tokens).

  Args:
    tokens: bf16 [M, H].
    expert_ids: int [M, K]; an id outside [0, E) (E: routed nowhere, e.g. an expert held by
      another device) gives a zero row and reads nothing.
    experts, block_rows, int4_dequant, expected_rows, tiles, interpret: as ``moe_experts``
      (``expected_rows`` defaults to M x K).
    item_programs: programs along the pairs (static). None (default): ``default_pair_programs``
      (one per pair unless ``expected_rows`` is below the pairs, e.g. 2 for an expert-parallel
      share's 1 expected live pair of 8). Fewer than the pairs (at most
      ``LIVE_FIRST_MAX_ITEMS`` pairs): a compact grid whose programs find the live pairs (ids in
      [0, E)) in their prologue and take them first, so the dead pairs of a step (the experts
      held by other devices) launch no programs of their own; more live pairs than programs run
      in a second round. The same rows bit for bit either way.
  Returns:
    bf16 [M, K, H]: row [m, j] = down(silu(x @ gate) * (x @ up)) of tokens[m] through expert
    expert_ids[m, j]; each the same, bit for bit, as ``moe_experts`` gives that row.
  """
  return forward_only("moe_experts_per_row", lambda x, w: _moe_experts_per_row(
      x, expert_ids, w, block_rows, int4_dequant, expected_rows, tiles, interpret, False, item_programs),
                      tokens, experts)


def _moe_experts_per_row(tokens, expert_ids, experts, block_rows, int4_dequant, expected_rows, tiles,
                         interpret, count_tile_loads, item_programs=None):
  interpret = interpret_params(interpret)
  if expert_ids.ndim != 2 or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise ValueError(f"expert_ids must be an integer array [M, K], got {expert_ids.dtype}{list(expert_ids.shape)}")
  if tokens.ndim != 2 or tokens.shape[0] != expert_ids.shape[0]:
    raise ValueError(f"tokens must be [M={expert_ids.shape[0]}, H] (one row per row of expert_ids), "
                     f"got shape {tokens.shape}")
  _, _, inter, e = _check_inputs(tokens, None, experts)
  pairs = expert_ids.size
  r, dequant = _resolve_options(pairs, e, inter, block_rows, int4_dequant, expected_rows, interpret,
                                is_int4=isinstance(experts, Int4Experts))
  tiles = tiles or default_tiles(experts, pairs if expected_rows is None else expected_rows, r)
  return _per_row(tokens, expert_ids, experts, r, dequant, tiles, interpret, count_tile_loads, item_programs,
                  expected_rows)


def _expert_projections(x, work_expert, block_start, experts, block_rows, dequant, tiles, interpret,
                        count_tile_loads=False, num_slots=None, item_programs=None, sizes=None, num_rows=None,
                        live_first=False):
  """gate/up then down: bf16 x [rows, H] -> bf16 [W * R, H] in the work layout (item w: expert
  work_expert[w], rows x[block_start[w] : block_start[w] + R]), or with a split down kernel its
  chunk sums f32 [C, 1, W, H, R] (``_work_rows`` takes rows of either). ``num_slots`` and
  ``item_programs``: a compact grid (``_visit_items``) for all kernels; with ``live_first`` (per-pair
  items) each kernel finds the live items itself (``_live_first``). With ``sizes`` (and
  ``num_rows``) in place of the list, the gate/up kernel builds it (``_grouped_kernel``) and the
  result comes with its ``KernelWork``."""
  tiles = tiles or default_tiles(experts)
  common = dict(block_rows=block_rows, int4_dequant=dequant, interpret=interpret,
                count_tile_loads=count_tile_loads, grid_order=tiles.grid_order, item_programs=item_programs,
                live_first=live_first, pdl=tiles.pdl)
  h = _grouped_kernel(x, work_expert, block_start, (experts.gate, experts.up), fuse_silu=True,
                      cfg=tiles.gate_up, num_slots=num_slots, sizes=sizes, num_rows=num_rows, **common)
  work = None
  if sizes is not None:
    h, work = h
    work_expert, num_slots = work.expert, work.num_slots
  compact = dict(num_slots=num_slots, item_programs=item_programs, live_first=live_first)
  common.update(compact)
  h, h_loads = h if count_tile_loads else (h, None)
  if h.ndim == 5:  # split gate/up: its chunk sums, added and through SiLU in a small kernel
    h = _fold_kernel(h, work_expert, n_out=_weight_dims((experts.gate,), tiles.gate_up.block_k)[2],
                     num_experts=_num_experts(experts), fuse_silu=True, interpret=interpret, pdl=tiles.pdl,
                     **compact)
  out = _grouped_kernel(h, work_expert, None, (experts.down,), fuse_silu=False, cfg=tiles.down, **common)
  if count_tile_loads:
    out, out_loads = out
    out = out, h_loads, out_loads
  return out if work is None else (out, work)


def _work_rows(out, index, n_out: int):
  """bf16 [M, n_out]: rows ``index`` (int[M], positions in the work layout [W * R]) of the down
  kernel's result: bf16 [W * R, H], or its chunk sums f32 [C, 1, W, H', R] (H' = H in whole output
  tiles) added in chunk order as an unsplit program adds them (XLA fuses the adds into the gather:
  only the taken rows are read)."""
  if out.ndim == 2:
    return jnp.take(out, index, axis=0)
  r = out.shape[-1]
  item, row = index // r, index % r
  total = out[0, 0, item, :n_out, row]
  for c in range(1, out.shape[0]):
    total = total + out[c, 0, item, :n_out, row]
  return total.astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=STATIC_OPTIONS + ("item_programs", "work_list_impl"))
def moe_experts_with_tile_loads(x_sorted, group_sizes, experts, *, block_rows: int | None = None,
                                int4_dequant: str | None = None, expected_rows: int | None = None,
                                tiles: KernelTiles | None = None, interpret=None,
                                sorted_expert_ids=None, item_programs: int | None = None,
                                work_list_impl: str | None = None):
  """``moe_experts`` plus the weight tiles each program loaded (the structural check).

  Returns:
    (y [A, H], gate_up_steps int32 [ceil(I / 64), W], down_steps int32 [ceil(H / 64), W]): the
    pipeline steps inside K run for each (output tile, item slot), each loading one [64, block_k]
    tile of every weight of its kernel (gate and up, or down), summed over a split's chunk
    programs; 0 where the slot was skipped (its expert -1 or outside [0, E), or past the slots).
  """
  return _moe_experts(x_sorted, group_sizes, experts, block_rows, int4_dequant, expected_rows, tiles, interpret,
                      True, sorted_expert_ids, None, item_programs, work_list_impl)


def reference_experts(x_sorted, group_sizes, experts):
  """The plain reference in float32: ragged_dot on bf16 weights (dequantised first for INT4)."""
  if isinstance(experts, Int4Experts):
    experts = dequantize_experts(experts)
  x = x_sorted.astype(jnp.float32)
  gate = lax.ragged_dot(x, experts.gate.astype(jnp.float32), group_sizes, precision=lax.Precision.HIGHEST)
  up = lax.ragged_dot(x, experts.up.astype(jnp.float32), group_sizes, precision=lax.Precision.HIGHEST)
  hidden = jax.nn.silu(gate) * up
  return lax.ragged_dot(hidden, experts.down.astype(jnp.float32), group_sizes,
                        precision=lax.Precision.HIGHEST)
