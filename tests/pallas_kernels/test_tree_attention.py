"""The Mosaic GPU tree-attention kernel against the plain-jnp reference, in GPU interpret mode (CPU).

Every call runs under ``plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)``:
shared memory starts as NaN (an unwritten tile would poison the output) and the interpreter's race
detector must report nothing. The kernel multiplies in bfloat16, so the reference gets the same
bf16-rounded inputs and computes in float32; what remains is the kernel's own rounding of the
probabilities and of the per-split partial outputs to bf16 (bound below).

Shapes are small (interpret mode runs every warpgroup in Python); two cases use Kimi's widths.
"""

import dataclasses
import functools
import numpy as np
import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_jax import tree as tree_lib
from models import kimi
from models.config import KimiConfig
from pallas_kernels import reference
from pallas_kernels import tree_attention as ta
from tests.pallas_kernels import conftest

INTERPRET = plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
# The kernel rounds the probabilities to bf16 (2^-9 relative) for the second product; on these
# unit-normal values that leaves errors up to ~2e-3. A flipped visibility bit of a real row moves
# that row's output by ~2e-2 to 3 here (sharp attention, prominent window keys), so 5e-3 catches
# mask errors. With bf16 partial outputs one more 2^-9 rounding of |o| < ~4 adds up to ~8e-3.
ATOL = 5e-3
ATOL_BF16_PARTIALS = 1.5e-2


def bf16(x):
  # Rounded on the host (ml_dtypes rounds to nearest even, as XLA's convert does): eager jnp
  # converts compile once per new shape, and nearly every test here has its own shapes.
  return jnp.asarray(np.asarray(x).astype(jnp.bfloat16).astype(np.float32))


# The reference under jit: op by op it compiled each of its ops for every test's new shapes
# (about a second a test). Same function, same inputs; only XLA's fusion of it differs.
mla_reference = jax.jit(reference.mla_tree_attention, static_argnames="scale")
mha_reference = jax.jit(reference.mha_tree_attention, static_argnames="scale")
# The trees' ancestor closure, jitted for the same reason (boolean, so exactly as eager).
_visibility_from_parents = jax.jit(tree_lib.visibility_from_parents)


def random_window(rng, batch, q_len, cache_len, *, tree=True):
  """Random trees (parents before children) with random padding; distinct slots and lengths.

  Returns (slots, prefix_len, visibility, valid) as jnp arrays.
  """
  parents = np.zeros((batch, q_len), np.int32)
  valid = np.ones((batch, q_len), bool)
  for b in range(batch):
    parents[b, 0] = -1
    for i in range(1, q_len):
      parents[b, i] = rng.integers(0, i)
    if q_len > 1:
      # Random padding: each non-root row is padded with probability 0.3, and so are its
      # descendants (padding comes from a smaller tree), except one batch row stays full.
      if b != 0:
        pad = rng.random(q_len) < 0.3
        pad[0] = False
        for i in range(1, q_len):
          pad[i] |= pad[parents[b, i]]
        valid[b] = ~pad
  if tree:
    visibility = np.asarray(_visibility_from_parents(jnp.asarray(parents), jnp.asarray(valid)))
  else:  # any relation at all: the kernel must not assume ancestor closure
    visibility = rng.random((batch, q_len, q_len)) < 0.5
  slots = rng.permutation(batch + 2)[:batch].astype(np.int32)
  prefix_len = rng.integers(0, cache_len - q_len + 1, size=batch).astype(np.int32)
  return (jnp.asarray(slots), jnp.asarray(prefix_len), jnp.asarray(visibility), jnp.asarray(valid))


def check_no_races():
  """Every kernel of the call so far (attention and merge), not only the last: see conftest."""
  assert not conftest.races_found(), "the GPU interpreter reported a data race"


def run_mla(rng, *, batch, q_len, heads, latent, rope, cache_len, num_splits=None, dtype=jnp.float32,
            tree=True, partial_dtype="float32", options=None):
  slots, prefix_len, visibility, valid = random_window(rng, batch, q_len, cache_len, tree=tree)
  pool = batch + 2
  q_lat = rng.standard_normal((batch, q_len, heads, latent)).astype(np.float32)
  q_rope = rng.standard_normal((batch, q_len, heads, rope)).astype(np.float32)
  c_kv = rng.standard_normal((pool, cache_len, latent)).astype(np.float32)
  k_pe = rng.standard_normal((pool, cache_len, rope)).astype(np.float32)
  # Sharp attention, and the window's rope keys scaled up so window columns often carry most of
  # the weight: a wrong mask bit then moves the output by far more than the tolerance.
  for slot, start in zip(np.asarray(slots), np.asarray(prefix_len)):
    k_pe[slot, start:start + q_len] *= 3.0
  scale = 1.5 / np.sqrt(latent + rope)
  args = [jnp.asarray(x, dtype) for x in (q_lat, q_rope, c_kv, k_pe)]
  got = ta.mla_tree_attention(*args, slots, prefix_len, visibility, valid, scale=scale,
                              interpret=INTERPRET, num_splits=num_splits,
                              partial_dtype=partial_dtype, options=options)
  check_no_races()
  want = mla_reference(*map(bf16, args), slots, prefix_len, visibility, valid, scale=scale)
  return np.asarray(got), np.asarray(want), np.asarray(valid)


def assert_matches(got, want, valid, atol=ATOL):
  assert got.dtype == np.float32 and got.shape == want.shape
  assert np.isfinite(got).all()
  real = valid[:, :, None, None] & np.ones(got.shape, bool)
  np.testing.assert_allclose(got[real], want[real], atol=atol, rtol=0)
  # Padded rows see only their own column: finite, and equal to that column's value row.
  np.testing.assert_allclose(got[~real], want[~real], atol=atol, rtol=0)


@pytest.mark.parametrize("q_len", [1, 2, 5, 9, 16, 17, 23, 32, 33, 64, 65])
def test_mla_matches_reference_on_random_trees(q_len):
  # Cache lengths 203 + Q: rarely a multiple of the 64-column tile or of 8 (the kernel pads the
  # pool then); three splits so that each request's columns cross split and tile borders at
  # different places. Latent 128: two value warpgroups, as at Kimi's width (P^T handed over).
  rng = np.random.default_rng(q_len)
  got, want, valid = run_mla(rng, batch=2, q_len=q_len, heads=2, latent=128, rope=32,
                             cache_len=203 + q_len, num_splits=3)
  assert_matches(got, want, valid)


def test_mla_window_past_the_pool_matches_reference():
  # A last prefill chunk can run past the pool (its write dropped): request 0's window holds
  # columns 68..71 of a 70-column pool, its rows 2 and 3 padded and seeing nothing (0 in both).
  rng = np.random.default_rng(70)
  q_len, cache_len = 4, 70
  args = [jnp.asarray(rng.standard_normal(shape), jnp.float32)
          for shape in ((2, q_len, 2, 64), (2, q_len, 2, 32), (3, cache_len, 64), (3, cache_len, 32))]
  slots, prefix_len = jnp.asarray([1, 2]), jnp.asarray([68, 30])
  visibility = jnp.asarray(np.tril(np.ones((2, q_len, q_len), bool)))
  valid = jnp.asarray([[True, True, False, False], [True] * q_len])
  got = np.asarray(ta.mla_tree_attention(*args, slots, prefix_len, visibility, valid, scale=0.1,
                                         interpret=INTERPRET, partial_dtype="float32"))
  check_no_races()
  want = np.asarray(mla_reference(*map(bf16, args), slots, prefix_len, visibility, valid, scale=0.1))
  assert (got[0, 2:] == 0).all() and (want[0, 2:] == 0).all()
  assert_matches(got, want, np.asarray(valid))


def test_mla_pool_shorter_than_a_tile_with_an_idle_request():
  # A 20-column pool (under one 64-column tile), request 0 at prefix 0 (its window only), request 1
  # idle (every row padded: a batch slot with no request), request 2 at prefix 12.
  rng = np.random.default_rng(20)
  q_len, cache_len = 5, 20
  args = [jnp.asarray(rng.standard_normal(shape), jnp.float32)
          for shape in ((3, q_len, 2, 64), (3, q_len, 2, 32), (4, cache_len, 64), (4, cache_len, 32))]
  slots, prefix_len = jnp.asarray([3, 0, 1]), jnp.asarray([0, 0, 12])
  visibility = jnp.asarray(np.tril(np.ones((3, q_len, q_len), bool)))
  valid = jnp.asarray([[True] * q_len, [False] * q_len, [True, True, True, False, False]])
  got = np.asarray(ta.mla_tree_attention(*args, slots, prefix_len, visibility, valid, scale=0.1,
                                         interpret=INTERPRET, partial_dtype="float32"))
  check_no_races()
  want = np.asarray(mla_reference(*map(bf16, args), slots, prefix_len, visibility, valid, scale=0.1))
  assert_matches(got, want, np.asarray(valid))


@pytest.mark.parametrize("form", ["rows_n", "rows_m"])
def test_mla_any_visibility_relation_and_more_splits_than_tiles(form):
  # A non-tree visibility and 8 splits over at most 4 tiles: empty splits must merge away.
  # "rows_m" forced on 21 rows: one 64-row tile, mostly padding rows past the queries' end.
  rng = np.random.default_rng(100)
  got, want, valid = run_mla(rng, batch=2, q_len=7, heads=3, latent=128, rope=32, cache_len=250,
                             num_splits=8, tree=False, options=ta.Options(form=form))
  assert_matches(got, want, valid)


@pytest.mark.parametrize("options", [ta.Options(lazy_sum=True, merge="pairwise"),
                                     ta.Options(lazy_sum=False, merge="two_pass",
                                                reduction_scratch=2048),
                                     ta.Options(pv="split"), ta.Options(pv="split", lazy_sum=False)])
def test_mla_kernel_options(options):
  # Both settings of each kernel variant the benchmark compares (the softmax sum per tile or once
  # at the end, the two merges, one or several reduction rounds).
  rng = np.random.default_rng(102)
  got, want, valid = run_mla(rng, batch=2, q_len=9, heads=2, latent=128, rope=32, cache_len=250,
                             num_splits=2, options=options)
  assert_matches(got, want, valid)


def test_merges_agree_with_empty_and_far_apart_splits():
  # The pairwise merge (weights 1 / sum_t 2^(lse_t - lse_s)) against the max-first merge and a
  # float64 merge: empty splits (-inf), a split 300 log2-units above the rest (its terms
  # overflow to inf and the others get weight 0), and rows that no split saw (sliced off).
  rng = np.random.default_rng(5)
  bg, n_rt, splits, dv, rt = 2, 2, 6, 128, 16
  o = rng.standard_normal((bg, splits, n_rt, rt, dv)).astype(np.float32)  # partials [rows, Dv]
  lse = (rng.standard_normal((bg, splits, n_rt, rt)) * 20).astype(np.float32)
  lse[0, 1, 0] = -np.inf
  lse[1, :, 1, 3] = -np.inf
  lse[1, 2, 1, 3] = 5.0  # only one split saw this row
  lse[0, 4, 1, :] += 300.0
  lse[:, :, -1, -4:] = -np.inf  # padding rows of the last tile
  rows = n_rt * rt - 4
  with np.errstate(invalid="ignore"):  # the padding rows (all -inf), sliced off below
    weight = np.exp2(lse.astype(np.float64) - lse.max(axis=1, keepdims=True))
  want = (weight[..., None] * o).sum(1) / weight.sum(1)[..., None]
  want = want.reshape(bg, n_rt * rt, dv)[:, :rows]
  for merge in ("pairwise", "two_pass", "kernel"):
    pl_ = ta.Plan(rows_per_tile=rt, num_row_tiles=n_rt, swizzle=128, num_stages=2,
                  num_splits=splits, rows_stored=rt, reduction_scratch=2048, value_wgs=1,
                  options=ta.Options(merge=merge))
    got = np.asarray(ta._merge(jnp.asarray(o), jnp.asarray(lse), pl_, rows, interpret=INTERPRET))
    if merge == "kernel":
      check_no_races()
    assert got.shape == want.shape and np.isfinite(got).all(), merge
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=merge)


def test_merges_select_unwritten_splits_away():
  # Options.live_splits: splits at or past a request's own count are never written, so their
  # partials and log-sum-exps hold whatever the buffer held (NaN, inf, huge values here). Each
  # merge must give the float64 merge of the written splits alone.
  rng = np.random.default_rng(6)
  bg, n_rt, splits, dv, rt = 3, 2, 6, 128, 16
  counts = np.array([1, 4, 6], np.int32)
  o = rng.standard_normal((bg, splits, n_rt, rt, dv)).astype(np.float32)
  lse = (rng.standard_normal((bg, splits, n_rt, rt)) * 20).astype(np.float32)
  lse[:, :, -1, -4:] = -np.inf  # padding rows of the last tile
  rows = n_rt * rt - 4
  written = np.arange(splits)[None, :] < counts[:, None]
  want_lse = np.where(written[:, :, None, None], lse, -np.inf).astype(np.float64)
  with np.errstate(invalid="ignore"):
    weight = np.exp2(want_lse - want_lse.max(axis=1, keepdims=True))
  weight = np.where(written[:, :, None, None], weight, 0.0)
  want = (weight[..., None] * np.where(written[:, :, None, None, None], o, 0.0)).sum(1)
  want = (want / weight.sum(1)[..., None]).reshape(bg, n_rt * rt, dv)[:, :rows]
  garbage = np.array([np.nan, np.inf, -np.inf, 3e38], np.float32)
  unwritten = ~written
  o[unwritten] = rng.choice(garbage, size=o[unwritten].shape)
  lse[unwritten] = rng.choice(np.array([np.nan, np.inf, 1e30], np.float32), size=lse[unwritten].shape)
  for merge in ("pairwise", "two_pass", "kernel"):
    pl_ = ta.Plan(rows_per_tile=rt, num_row_tiles=n_rt, swizzle=128, num_stages=2,
                  num_splits=splits, rows_stored=rt, reduction_scratch=2048, value_wgs=1,
                  options=ta.Options(merge=merge, live_splits=True))
    got = np.asarray(ta._merge(jnp.asarray(o), jnp.asarray(lse), pl_, rows, interpret=INTERPRET,
                               live_counts=jnp.asarray(counts)))
    if merge == "kernel":
      check_no_races()
    assert got.shape == want.shape and np.isfinite(got).all(), merge
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=merge)


@pytest.mark.parametrize("dv,columns", [(384, 0), (384, 384), (1024, 0), (1024, 512)])
def test_merge_kernel_row_mapping_and_wide_rows(dv, columns):
  # The merge kernel (one CTA per output row and column block) on two row tiles of 16 rows, a row
  # count that ends inside the second tile, and rows at every place inside their box of 4
  # log-sum-exps. Dv 384: 3 blocks of 128 columns by default, one whole row at columns 384; Dv
  # 1024: 4 blocks of 256 by default, 2 blocks of 2 chunks of 256 at columns 512. Every row's
  # weights differ, so a row or column block read from the wrong tile, row, block or split fails.
  # No XLA reductions remain.
  assert [ta._merge_columns(384, c) for c in (0, 64, 128, 384, 1024)] == [128, 128, 128, 384, 384]
  assert [ta._merge_columns(512, c) for c in (0, 128)] == [ta.MERGE_COLUMNS, 128]
  assert ta._merge_chunk(1024, 512) == 256
  # No block of a multiple of 128 columns (what the GPU kernel compiles for): the XLA merge.
  for width in (64, 192, 320, 400):
    assert not ta._merge_kernel_fits((1, 4, 1, 64, width), (1, 4, 1, 64))
  rng = np.random.default_rng(6)
  bg, n_rt, splits, rt = 2, 2, 5, 16
  o = rng.standard_normal((bg, splits, n_rt, rt, dv)).astype(np.float32)
  lse = (rng.standard_normal((bg, splits, n_rt, rt)) * 8).astype(np.float32)
  lse[1, 3] = -np.inf
  o[1, 3] = 0.0
  rows = n_rt * rt - 3
  weight = np.exp2(lse.astype(np.float64) - lse.max(axis=1, keepdims=True))
  want = ((weight[..., None] * o).sum(1) / weight.sum(1)[..., None]).reshape(bg, n_rt * rt, dv)
  pl_ = ta.Plan(rows_per_tile=rt, num_row_tiles=n_rt, swizzle=128, num_stages=2,
                num_splits=splits, rows_stored=rt, reduction_scratch=0, value_wgs=1,
                options=ta.Options(merge="kernel", merge_columns=columns))
  got = np.asarray(ta._merge(jnp.asarray(o), jnp.asarray(lse), pl_, rows, interpret=INTERPRET))
  check_no_races()
  np.testing.assert_allclose(got, want[:, :rows], rtol=1e-5, atol=1e-5)
  jaxpr = jax.make_jaxpr(lambda a, b: ta._merge(a, b, pl_, rows))(jnp.asarray(o), jnp.asarray(lse))
  assert not {e.primitive.name for e in jaxpr.eqns} & {"reduce_sum", "exp2", "reduce_max"}
  # Too many splits for one CTA's shared memory: the XLA merge instead (same result).
  assert not ta._merge_kernel_fits((1, 200, 3, 64, 512), (1, 200, 3, 64), 512)
  assert ta._merge_kernel_fits((1, 200, 3, 64, 512), (1, 200, 3, 64), 128)
  assert ta._merge_kernel_fits((1, 43, 3, 64, 512), (1, 43, 3, 64), 512)


def test_merge_kernel_blocks_narrow_below_64_merged_rows():
  # merge_columns=0 resolves to 128 columns a CTA below FEW_MERGED_ROWS merged rows (8 rows of
  # q_len 1 at 8 heads: 4 blocks of Dv 512, 32 CTAs) and MERGE_COLUMNS from there.
  assert [ta._default_merge_columns(n) for n in (8, 56, 63, 64, 512)] == [128] * 3 + [ta.MERGE_COLUMNS] * 2
  rng = np.random.default_rng(12)
  splits, dv, rt = 6, 512, 8
  o = jnp.asarray(rng.standard_normal((1, splits, 1, rt, dv)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((1, splits, 1, rt)) * 4, jnp.float32)

  def merge(columns, interpret=None):
    pl_ = ta.Plan(rows_per_tile=rt, num_row_tiles=1, swizzle=128, num_stages=2, num_splits=splits,
                  rows_stored=rt, reduction_scratch=0, value_wgs=1,
                  options=ta.Options(merge_columns=columns))
    return lambda a, b: ta._merge(a, b, pl_, rt, interpret=interpret)

  def kernel_grids(jaxpr):  # the grids of the Mosaic GPU kernels (plgpu.kernel meshes) inside
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "mpmd_map":
        yield from (mesh.grid for mesh in eqn.params["meshes"])
      for value in eqn.params.values():  # custom_vmap_call holds its body as a bare Jaxpr
        for sub in value if isinstance(value, (tuple, list)) else [value]:
          sub = getattr(sub, "jaxpr", sub)
          if isinstance(sub, jax.extend.core.Jaxpr):
            yield from kernel_grids(sub)

  grids = list(kernel_grids(jax.make_jaxpr(merge(0))(o, lse).jaxpr))
  assert grids == [(1, rt, dv // 128)], grids
  # From 64 merged rows, MERGE_COLUMNS (256) a CTA.
  o64, lse64 = jnp.zeros((8, splits, 1, rt, dv)), jnp.zeros((8, splits, 1, rt))
  grids = list(kernel_grids(jax.make_jaxpr(merge(0))(o64, lse64).jaxpr))
  assert grids == [(8, rt, dv // ta.MERGE_COLUMNS)], grids
  got = np.asarray(merge(0, INTERPRET)(o, lse))
  check_no_races()
  weight = np.exp2(np.asarray(lse, np.float64) - np.asarray(lse).max(axis=1, keepdims=True))
  want = (weight[..., None] * np.asarray(o, np.float64)).sum(1) / weight.sum(1)[..., None]
  np.testing.assert_allclose(got, want.reshape(1, rt, dv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_kernel_lowers_for_cuda_wherever_it_fits(dtype):
  # The interpreter runs any block width, the GPU compiler does not: 64-column blocks failed
  # Mosaic GPU's layout inference on the H200 (MHA with D=64). Lowering for CUDA runs that
  # inference on the CPU; every width _merge_kernel_fits accepts must pass it.
  sds = jax.ShapeDtypeStruct
  shapes = set()  # (columns per CTA, columns per TMA box row): what the kernel's code depends on
  for dv in range(128, 2049, 128):
    for columns in (0, 128, 256, 384, 512, 640, 768, 1024, 4096):
      o, lse = sds((2, 5, 2, 64, dv), dtype), sds((2, 5, 2, 64), jnp.float32)
      assert ta._merge_kernel_fits(o.shape, lse.shape, columns, jnp.dtype(dtype).itemsize)
      cols = ta._merge_columns(dv, columns)
      shape = (cols, ta._merge_chunk(dv, cols, jnp.dtype(dtype).itemsize))
      if shape not in shapes:
        shapes.add(shape)
        merge = functools.partial(ta._merge_kernel, rows=100, columns=columns)
        jax.jit(merge).trace(o, lse).lower(lowering_platforms=("cuda",))
  assert len(shapes) >= 16  # blocks of 128 to 2048 columns, boxes of 128 or 256


def test_rows_m_register_counts_lower_for_cuda():
  # setmaxnreg counts other than 232/232 in form "rows_m" at Kimi widths (q17 x 8 heads, bf16):
  # the kernel must still pass Mosaic GPU's lowering (layout inference, shared memory), and the
  # counts must reach the module (its serialised text holds the inline-PTX strings). A 1k pool:
  # the pool's length sets only the launched splits (16 here), over which the merge kernel
  # lowered beside it is unrolled (43 at 4k took twice the time).
  sds = jax.ShapeDtypeStruct
  b, q, n = 1, 17, 8
  args = (sds((b, q, n, 512), jnp.bfloat16), sds((b, q, n, 64), jnp.bfloat16),
          sds((2, 1024, 512), jnp.bfloat16), sds((2, 1024, 64), jnp.bfloat16),
          sds((b,), jnp.int32), sds((b,), jnp.int32), sds((b, q, q), jnp.bool_), sds((b, q), jnp.bool_))
  for regs in ((256, 208), (240, 224)):
    f = functools.partial(ta.mla_tree_attention, scale=0.1,
                          options=ta.Options(form="rows_m", regs=regs))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for count in set(regs):
      assert f"setmaxnreg.inc.sync.aligned.u32 {count};" in text


def test_merge_kernel_reads_bf16_partials_as_stored():
  # bf16 partials: the kernel loads them as they are (no XLA conversion of the partials before
  # it) and widens them in registers; same result as the XLA merge of the same bf16 values.
  rng = np.random.default_rng(12)
  bg, n_rt, splits, dv, rt, rows = 2, 2, 6, 512, 16, 27
  o = jnp.asarray(rng.standard_normal((bg, splits, n_rt, rt, dv)), jnp.bfloat16)
  lse = jnp.asarray(rng.standard_normal((bg, splits, n_rt, rt)) * 6, jnp.float32)
  plans = {m: ta.Plan(rows_per_tile=rt, num_row_tiles=n_rt, swizzle=128, num_stages=2,
                      num_splits=splits, rows_stored=rt, reduction_scratch=0, value_wgs=1,
                      partial_dtype="bfloat16", options=ta.Options(merge=m)) for m in ("kernel", "pairwise")}
  got = np.asarray(ta._merge(o, lse, plans["kernel"], rows, interpret=INTERPRET))
  check_no_races()
  want = np.asarray(ta._merge(o, lse, plans["pairwise"], rows))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  jaxpr = jax.make_jaxpr(lambda a, b: ta._merge(a, b, plans["kernel"], rows))(o, lse)
  assert "convert_element_type" not in {e.primitive.name for e in jaxpr.eqns}
  # Blocks of a multiple of 128 columns in either dtype (what the GPU compiles), nothing narrower.
  for itemsize in (2, 4):
    assert ta._merge_kernel_fits((1, 4, 1, 8, 128), (1, 4, 1, 8), 0, itemsize)
    assert not ta._merge_kernel_fits((1, 4, 1, 8, 64), (1, 4, 1, 8), 0, itemsize)


def test_merges_give_zeros_for_a_row_no_split_saw():
  # A real row whose every split is empty (lse -inf everywhere, zero partials) merges to zeros in
  # every merge, not NaN (2^(-inf - -inf), or 0 / 0 in "two_pass", which gave NaN until it
  # guarded its sum); the rows beside it are unaffected.
  rng = np.random.default_rng(7)
  bg, n_rt, splits, dv, rt = 1, 1, 3, 128, 8
  o = rng.standard_normal((bg, splits, n_rt, rt, dv)).astype(np.float32)
  lse = (rng.standard_normal((bg, splits, n_rt, rt)) * 4).astype(np.float32)
  lse[0, :, 0, 2] = -np.inf
  o[0, :, 0, 2] = 0.0
  rows = 6
  got = {}
  for merge in ("kernel", "pairwise", "two_pass"):
    pl_ = ta.Plan(rows_per_tile=rt, num_row_tiles=n_rt, swizzle=128, num_stages=2,
                  num_splits=splits, rows_stored=rt, reduction_scratch=0, value_wgs=1,
                  options=ta.Options(merge=merge))
    got[merge] = np.asarray(ta._merge(jnp.asarray(o), jnp.asarray(lse), pl_, rows,
                                      interpret=INTERPRET))
  check_no_races()
  for merge in got:
    assert np.isfinite(got[merge]).all(), merge
    np.testing.assert_array_equal(got[merge][0, 2], np.zeros(dv, np.float32), err_msg=merge)
    np.testing.assert_allclose(got[merge], got["pairwise"], rtol=1e-5, atol=1e-6, err_msg=merge)


def test_merge_kernel_falls_back_to_xla_where_it_does_not_fit():
  # Where one row block of every split exceeds the merge kernel's shared memory (or a TMA box's
  # 256 splits), merge="kernel" must run the XLA merge: no kernel in the jaxpr, the pairwise result.
  rng = np.random.default_rng(9)
  bg, n_rt, splits, dv, rt, rows = 1, 1, 100, 512, 64, 8  # 100 x (512 + 4) x 4 B > 200 KB
  o = jnp.asarray(rng.standard_normal((bg, splits, n_rt, rt, dv)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((bg, splits, n_rt, rt)) * 4, jnp.float32)
  assert not ta._merge_kernel_fits(o.shape, lse.shape, 512)
  assert not ta._merge_kernel_fits((1, 300, 1, 8, 128), (1, 300, 1, 8))  # box dimension > 256
  assert ta._merge_kernel_fits((1, 256, 1, 8, 128), (1, 256, 1, 8))
  assert not ta._merge_kernel_fits((1, 4, 1, 6, 128), (1, 4, 1, 6))  # lse not in boxes of 4
  plans = {m: ta.Plan(rows_per_tile=rt, num_row_tiles=n_rt, swizzle=128, num_stages=2,
                      num_splits=splits, rows_stored=rt, reduction_scratch=0, value_wgs=1,
                      options=ta.Options(merge=m, merge_columns=512)) for m in ("kernel", "pairwise")}
  merge = lambda m: (lambda a, b: ta._merge(a, b, plans[m], rows, interpret=INTERPRET))
  prims = {m: {e.primitive.name for e in jax.make_jaxpr(merge(m))(o, lse).eqns}
           for m in plans}
  assert prims["kernel"] == prims["pairwise"] and "reduce_sum" in prims["kernel"]
  np.testing.assert_array_equal(np.asarray(merge("kernel")(o, lse)),
                                np.asarray(merge("pairwise")(o, lse)))


def test_merge_auto_takes_the_kernel_only_where_it_was_timed():
  # merge="auto" (the default): the merge kernel for MERGE_KERNEL_ROWS merged rows (bg x rows) of
  # float32 partials and MERGE_KERNEL_ROWS_BF16 of bf16, the XLA merge otherwise; same results.
  assert ta.Options().merge == "auto"
  rng = np.random.default_rng(11)
  splits, dv, rt = 4, 128, 64
  lo, hi = ta.MERGE_KERNEL_ROWS

  def kinds(bg, rows, dtype):
    n_rt = -(-rows // rt)
    o = jnp.asarray(rng.standard_normal((bg, splits, n_rt, rt, dv)), dtype)
    lse = jnp.asarray(rng.standard_normal((bg, splits, n_rt, rt)) * 4, jnp.float32)
    plans = {m: ta.Plan(rows_per_tile=rt, num_row_tiles=n_rt, swizzle=128, num_stages=2,
                        num_splits=splits, rows_stored=rt, reduction_scratch=0, value_wgs=1,
                        options=ta.Options(merge=m)) for m in ("auto", "kernel", "pairwise")}
    prims = {m: {e.primitive.name for e in jax.make_jaxpr(
        lambda a, b, m=m: ta._merge(a, b, plans[m], rows))(o, lse).eqns} for m in plans}
    assert prims["kernel"] != prims["pairwise"]  # the two are told apart
    return "kernel" if prims["auto"] == prims["kernel"] else (
        "pairwise" if prims["auto"] == prims["pairwise"] else prims["auto"])

  assert lo == 8  # q_len 1 at 8 heads and batch 1 takes the kernel (timed faster there)
  assert kinds(1, lo, jnp.float32) == "kernel"
  assert kinds(1, lo - 4, jnp.float32) == "pairwise"
  assert kinds(2, hi // 2, jnp.float32) == "kernel"
  assert kinds(3, hi // 2, jnp.float32) == "pairwise"
  lo16, hi16 = ta.MERGE_KERNEL_ROWS_BF16
  assert kinds(1, lo16, jnp.bfloat16) == "kernel"
  assert kinds(1, hi16, jnp.bfloat16) == "kernel"
  assert kinds(1, lo16 - 8, jnp.bfloat16) == "pairwise"
  assert kinds(1, hi16 + 8, jnp.bfloat16) == "pairwise"


# Slow only: test_mla_any_visibility_relation_and_more_splits_than_tiles runs the same path in both
# forms (the merge kernel, which "auto" takes for its 42 merged rows, after 8 splits over at most
# 4 tiles, live splits on for its batch of 2).
@pytest.mark.slow
@pytest.mark.parametrize("form", ["rows_n", "rows_m"])
def test_mla_merge_kernel_end_to_end(form):
  # The whole call with the merge kernel, both forms, several splits (some empty).
  rng = np.random.default_rng(103)
  got, want, valid = run_mla(rng, batch=2, q_len=9, heads=2, latent=128, rope=32, cache_len=250,
                             num_splits=5, options=ta.Options(merge="kernel", form=form))
  assert_matches(got, want, valid)


def test_mla_bf16_partial_outputs():
  rng = np.random.default_rng(101)
  got, want, valid = run_mla(rng, batch=2, q_len=9, heads=2, latent=64, rope=32, cache_len=180,
                             num_splits=2, partial_dtype="bfloat16")
  assert_matches(got, want, valid, atol=ATOL_BF16_PARTIALS)


# "rows_n" and "auto" run the plans of test_long_split_kimi_widths[rows_n] and [rows_m] (the
# default's plan: test_auto_partials_and_epilogue): slow only.
@pytest.mark.parametrize("form", [pytest.param("rows_n", marks=pytest.mark.slow),
                                  pytest.param("auto", marks=pytest.mark.slow), "rows_m"])
def test_mla_kimi_widths_bf16_inputs(form):
  # Kimi's latent (512) and rope (64) widths with 8 heads (TP8), bf16 inputs, 17 rows of tree:
  # 136 rows in 3 tiles of 48 ("rows_n", fp32 partials) or of 64 (the default: "rows_m", 2 KV
  # stages, one P buffer, bf16 partials staged in the query tile and stored by TMA; "rows_m" here
  # with fp32 partials from registers, the previous default, at the tighter tolerance).
  if form == "auto":
    pl_ = ta.plan(q_len=17, heads_per_group=8, num_work=2, key_dims=(512, 64), value_dim=512,
                  shared_value=True, cache_len=136, num_splits=2, query_dtype=jnp.bfloat16)
    assert (pl_.form, pl_.partial_dtype, pl_.options.epilogue) == ("rows_m", "bfloat16", "smem")
  rng = np.random.default_rng(7)
  got, want, valid = run_mla(rng, batch=2, q_len=17, heads=8, latent=512, rope=64, cache_len=136,
                             num_splits=2, dtype=jnp.bfloat16, options=ta.Options(form=form),
                             partial_dtype="auto" if form == "auto" else "float32")
  assert_matches(got, want, valid, atol=ATOL_BF16_PARTIALS if form == "auto" else ATOL)
  if form == "rows_m":
    assert ta.plan(q_len=17, heads_per_group=8, num_work=2, key_dims=(512, 64), value_dim=512,
                   shared_value=True, cache_len=136, num_splits=2, partial_dtype="float32",
                   options=ta.Options(form="rows_m")).options.epilogue == "registers"


# The register epilogue on these shapes (33 x 4 rows, two words): test_long_split_demo_widths[rows_m].
@pytest.mark.parametrize("epilogue,partial_dtype", [pytest.param("registers", "float32", marks=pytest.mark.slow),
                                                    ("smem", "bfloat16")])
def test_mla_rows_m_window_across_tiles(epilogue, partial_dtype):
  # "rows_m" with 33 nodes x 4 heads = 132 rows (3 tiles, the last of 4 rows), two visibility
  # words, random padding, and caches whose windows straddle 64-column tiles and splits. The
  # "smem" epilogue stages O in the query tile: a store before warpgroup 0's last S, or a TMA
  # store before warpgroup 1's half is written, is a race here (or wrong values).
  rng = np.random.default_rng(31)
  got, want, valid = run_mla(rng, batch=2, q_len=33, heads=4, latent=128, rope=32,
                             cache_len=221, num_splits=3, partial_dtype=partial_dtype,
                             options=ta.Options(form="rows_m", epilogue=epilogue))
  assert_matches(got, want, valid, atol=ATOL if partial_dtype == "float32" else ATOL_BF16_PARTIALS)


def test_mla_rows_m_staged_epilogue_one_split_many_tiles():
  # One split over many KV tiles: the staged partial is the output itself (no merge after it),
  # bit for bit what the register stores of the same bf16 partials give.
  got = {}
  for epilogue in ("smem", "registers"):
    got[epilogue], want, valid = run_mla(
        np.random.default_rng(32), batch=2, q_len=9, heads=8, latent=128, rope=32, cache_len=700,
        num_splits=1, partial_dtype="bfloat16", options=ta.Options(form="rows_m", epilogue=epilogue))
  assert_matches(got["smem"], want, valid, atol=ATOL_BF16_PARTIALS)
  np.testing.assert_array_equal(got["smem"], got["registers"])


def test_staged_epilogue_and_probe_are_never_silently_ignored():
  kw = dict(q_len=17, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512,
            shared_value=True, cache_len=4096)
  assert ta.plan(**kw, partial_dtype="bfloat16", options=ta.Options(epilogue="smem")).form == "rows_m"
  # fp32 partials: an error, not a quiet switch to the form that ignores the option.
  for form in ("rows_m", "auto"):
    with pytest.raises(ValueError, match="epilogue='smem'.*bfloat16"):
      ta.plan(**kw, options=ta.Options(form=form, epilogue="smem"))
  with pytest.raises(ValueError, match="as wide as the values"):  # MHA whose query part != Dv
    ta.plan(q_len=17, heads_per_group=8, num_work=1, key_dims=(256,), value_dim=128,
            shared_value=False, cache_len=4096, partial_dtype="bfloat16",
            options=ta.Options(form="rows_m", epilogue="smem"))
  # 72 rows per group: "auto" takes "rows_n", which has no staged epilogue and no "nostore".
  nine = dict(kw, q_len=9)
  for options in (ta.Options(epilogue="smem"), ta.Options(probe="nostore")):
    with pytest.raises(ValueError, match="applies to form 'rows_m'"):
      ta.plan(**nine, partial_dtype="bfloat16", options=options)
  assert ta.plan(**nine, options=ta.Options(form="rows_m", probe="nostore")).form == "rows_m"
  with pytest.raises(ValueError, match="unknown epilogue"):
    ta.plan(**kw, options=ta.Options(epilogue="tma"))
  with pytest.raises(ValueError, match="partial_dtype must be"):
    ta.plan(**kw, partial_dtype="float16")
  for columns in (-5, 64, 200):  # the merge kernel's blocks are multiples of 128 columns
    with pytest.raises(ValueError, match="merge_columns"):
      ta.plan(**kw, options=ta.Options(merge_columns=columns))


@pytest.mark.parametrize("query_dtype,q_len,key_dims,value_dim,want", [
    # MLA at Kimi's widths, rows_m: bf16 queries stage bf16 partials; fp32 queries keep fp32.
    (jnp.bfloat16, 17, (512, 64), 512, ("rows_m", "bfloat16", "smem")),
    (jnp.float32, 17, (512, 64), 512, ("rows_m", "float32", "registers")),
    (None, 17, (512, 64), 512, ("rows_m", "float32", "registers")),
    # 72 rows per group: rows_n, whose bf16 partials (registers) were slower: fp32.
    (jnp.bfloat16, 9, (512, 64), 512, ("rows_n", "float32", "registers")),
    # rows_m whose query part 0 is narrower than the values cannot stage: fp32 from registers.
    (jnp.bfloat16, 17, (128, 32), 256, ("rows_m", "float32", "registers")),
])
def test_auto_partials_and_epilogue(query_dtype, q_len, key_dims, value_dim, want):
  kw = dict(q_len=q_len, heads_per_group=8, num_work=1, key_dims=key_dims, value_dim=value_dim,
            shared_value=key_dims[0] == value_dim, cache_len=4096)
  if key_dims[0] != value_dim:  # "auto" would take rows_n here; force the form in question
    kw["options"] = ta.Options(form="rows_m")
  auto = ta.plan(**kw, query_dtype=query_dtype)
  assert (auto.form, auto.partial_dtype, auto.options.epilogue) == want
  # "auto" never changes the row tiles (window metadata built without the query dtype serves).
  explicit = ta.plan(**dict(kw, options=dataclasses.replace(kw.get("options", ta.Options()),
                                                             epilogue="registers")),
                     partial_dtype="float32")
  assert (auto.rows_per_tile, auto.num_row_tiles, auto.num_splits) == (
      explicit.rows_per_tile, explicit.num_row_tiles, explicit.num_splits)
  # "auto" partials with the register epilogue asked for: float32 (bf16 stored from registers was
  # the slowest timed).
  registers = ta.plan(**dict(kw, options=dataclasses.replace(kw.get("options", ta.Options()),
                                                              epilogue="registers")),
                      query_dtype=query_dtype)
  assert (registers.partial_dtype, registers.options.epilogue) == ("float32", "registers")


def test_window_meta_prepared_for_auto_partials_serves_the_staged_epilogue():
  # prepare_mla_window does not know the queries' dtype; with "auto" it must accept what a bf16
  # call accepts (epilogue="smem") and build the same metadata as for the default epilogue.
  window = random_window(np.random.default_rng(4), 2, 17, 300)
  kw = dict(heads=8, latent_dim=512, rope_dim=64, cache_len=300)
  staged = ta.prepare_mla_window(*window, **kw, options=ta.Options(epilogue="smem"))
  default = ta.prepare_mla_window(*window, **kw)
  assert staged.layout == default.layout
  np.testing.assert_array_equal(np.asarray(staged.meta), np.asarray(default.meta))
  with pytest.raises(ValueError, match="partial_dtype='bfloat16' \\(got 'float32'\\)"):
    ta.prepare_mla_window(*window, **kw, partial_dtype="float32", options=ta.Options(epilogue="smem"))


def test_mla_demo_widths_full_budget():
  # The demo model: R=128, P=32, 6 heads, budget 64 (Q=65): 390 rows over several row tiles.
  rng = np.random.default_rng(8)
  got, want, valid = run_mla(rng, batch=1, q_len=65, heads=6, latent=128, rope=32, cache_len=140,
                             num_splits=1)
  assert_matches(got, want, valid)


# (9, 16, 2, 256, "rows_m"): its shapes run in "rows_m smem", its epilogue in (17, 8, 2, 128, "rows_m").
@pytest.mark.parametrize("q_len,heads,groups,dim,form", [
    (1, 4, 2, 64, "auto"), (9, 6, 2, 64, "auto"), (17, 4, 4, 64, "auto"), (17, 8, 2, 128, "auto"),
    (17, 8, 2, 128, "rows_m"), pytest.param(9, 16, 2, 256, "rows_m", marks=pytest.mark.slow),
    (9, 16, 2, 256, "rows_m smem")])
def test_mha_matches_reference(q_len, heads, groups, dim, form):
  # Separate V tiles. The default picks "rows_n" for all four auto cases (at most 68 rows per
  # group); the last three force "rows_m" (Dv 128 and 256: two value halves of 64 and 128), the
  # last with bf16 partials staged in the query tile (Options.epilogue="smem").
  rng = np.random.default_rng(200 + q_len)
  batch, cache_len = 2, 150
  slots, prefix_len, visibility, valid = random_window(rng, batch, q_len, cache_len)
  q = jnp.asarray(rng.standard_normal((batch, q_len, heads, dim)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((batch + 2, cache_len, groups, dim)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((batch + 2, cache_len, groups, dim)), jnp.float32)
  got = ta.mha_tree_attention(q, k, v, slots, prefix_len, visibility, valid, scale=0.125,
                              interpret=INTERPRET, num_splits=2,
                              partial_dtype="bfloat16" if "smem" in form else "float32",
                              options=ta.Options(form=form.split()[0],
                                                 epilogue="smem" if "smem" in form else "registers"))
  check_no_races()
  want = mha_reference(bf16(q), bf16(k), bf16(v), slots, prefix_len, visibility, valid, scale=0.125)
  assert_matches(np.asarray(got), np.asarray(want), np.asarray(valid),
                 atol=ATOL_BF16_PARTIALS if "smem" in form else ATOL)


def run_long_split(seed, *, q_len, heads, latent, rope, cache_len, prefix, form, dtype=jnp.float32):
  """One split per request over many KV tiles (more than the pipeline's stages), keys growing
  along the KV axis so the running max moves at every tile: stage reuse, P hand-off and the
  rescales all run many times."""
  rng = np.random.default_rng(seed)
  batch = len(prefix)
  slots, _, visibility, valid = random_window(rng, batch, q_len, cache_len)
  prefix_len = jnp.asarray(prefix, jnp.int32)
  q_lat = rng.standard_normal((batch, q_len, heads, latent)).astype(np.float32)
  q_rope = rng.standard_normal((batch, q_len, heads, rope)).astype(np.float32)
  c_kv = rng.standard_normal((batch + 2, cache_len, latent)).astype(np.float32)
  k_pe = rng.standard_normal((batch + 2, cache_len, rope)).astype(np.float32)
  k_pe *= np.linspace(0.5, 3.0, cache_len)[None, :, None]
  scale = 1.5 / np.sqrt(latent + rope)
  args = [jnp.asarray(x, dtype) for x in (q_lat, q_rope, c_kv, k_pe)]
  got = ta.mla_tree_attention(*args, slots, prefix_len, visibility, valid, scale=scale,
                              interpret=INTERPRET, num_splits=1, options=ta.Options(form=form))
  check_no_races()
  want = mla_reference(*map(bf16, args), slots, prefix_len, visibility, valid, scale=scale)
  # The default partials: bf16 (staged) for bf16 queries in "rows_m", else float32.
  bf16_partials = dtype == jnp.bfloat16 and form == "rows_m"
  assert_matches(np.asarray(got), np.asarray(want), np.asarray(valid),
                 atol=ATOL_BF16_PARTIALS if bf16_partials else ATOL)


@pytest.mark.parametrize("form", ["rows_n", "rows_m"])
def test_long_split_demo_widths(form):
  # Up to 8 tiles per CTA against 4 KV stages.
  run_long_split(1, q_len=33, heads=4, latent=128, rope=32, cache_len=500, prefix=[450, 300], form=form)


@pytest.mark.parametrize("form", ["rows_n", "rows_m"])
def test_long_split_kimi_widths(form):
  # Up to 5 tiles per CTA against 2 KV stages, bf16 inputs.
  run_long_split(2, q_len=17, heads=8, latent=512, rope=64, cache_len=300, prefix=[280, 150], form=form,
                 dtype=jnp.bfloat16)


_live_split_counts = jax.jit(ta._live_split_counts,
                             static_argnames=("cache_len", "ctas_per_request_split", "num_splits"))


def batch_split_cost(tiles, counts, ctas_per_request_split, sms):
  """The launched count's cost model over a whole batch: waves x (busiest CTA's tiles + 2)."""
  waves = -(-ctas_per_request_split * int(np.sum(counts)) // sms)
  return waves * (max(-(-t // c) for t, c in zip(tiles, counts)) + 2.0)


@pytest.mark.parametrize("lengths,ctas,launched,cache_len", [
    ([4113] * 8, 17, 27, 135_168),  # heads 64, batch 8, 4k live in the grid's pool: over-split
    ([4113] * 8, 3, 44, 135_168), ([40, 300, 900], 1, 16, 1000), ([131_000] * 4, 3, 44, 131_072),
    ([4096, 6720, 11026, 18089, 29679, 48693, 79889, 131072], 3, 11, 135_168),  # the bench's mix
    ([100, 100, 100, 125_000], 3, 44, 131_072), ([1, 64, 65, 129], 2, 300, 20_000),
    ([50, 700, 900, 1000], 2, 16, 1024),  # B x S above the pool's 16 tiles: every target
    # The bench's batch 32 of mixed lengths (h8 q9): a 2% margin took a busiest CTA 2% longer.
    ((np.round(32768 * np.exp2(-np.linspace(5, 0, 32))) + 9).astype(int).tolist(), 2, 2, 131_200)])
def test_live_split_counts_against_a_brute_force_search(lengths, ctas, launched, cache_len):
  # Options.live_splits: the counts, chosen for the batch together, cost what the best over every
  # tiles-per-split target costs under the cost model (brute force), with no more splits in all
  # than any equally cheap target gives; they are capped at the launched count, and every split
  # below a request's count gets columns while the ranges cover its live columns.
  sms = ta.num_sms()
  live = np.asarray(lengths)
  # Jitted (integer selection, the same counts as eager; the kernel's callers run it under jit as
  # well): op by op it compiled each op for every case's shapes, most of the test's time.
  counts = np.asarray(_live_split_counts(jnp.asarray(live, jnp.int32), cache_len=cache_len,
                                         ctas_per_request_split=ctas, num_splits=launched))
  tiles = -(-live // 64)
  options = [np.clip(-(-tiles // per), 1, launched) for per in range(1, tiles.max() + 1)]
  best = min(batch_split_cost(tiles, c, ctas, sms) for c in options)
  fewest = min(int(c.sum()) for c in options if batch_split_cost(tiles, c, ctas, sms) == best)
  assert batch_split_cost(tiles, counts, ctas, sms) == best, (counts, best)
  assert counts.sum() <= fewest, (counts, fewest)
  assert (1 <= counts).all() and (counts <= launched).all()
  for n, c in zip(live, counts):
    range_cols = -(-(-(-n // c)) // 64) * 64  # the kernel's range per split for this count
    assert (c - 1) * range_cols < n <= c * range_cols, (n, c)
  if len(set(lengths)) == 1:
    assert len(set(counts)) == 1
  # The long request of a batch keeps at least the splits of any shorter one.
  assert all(counts[i] <= counts[j] for i in range(len(live)) for j in range(len(live))
             if live[i] <= live[j] and -(-live[i] // 64) < -(-live[j] // 64))


# ("rows_n", "pairwise", 0): the same live-split kernel as ("rows_n", "two_pass", 2); the pairwise
# merge's selection of unwritten splits: test_merges_select_unwritten_splits_away.
@pytest.mark.parametrize("form,merge,groups", [pytest.param("rows_n", "pairwise", 0, marks=pytest.mark.slow),
                                               ("rows_m", "kernel", 0), ("rows_n", "two_pass", 2)])
def test_live_splits_short_contexts_in_a_long_pool(form, merge, groups, monkeypatch):
  # Options.live_splits: requests of 1, 3 and 7 live tiles in a pool of 8 launched splits get
  # 1, 3 and 7 splits. The results match the reference, and the CTAs of the other splits write
  # nothing: the interpreter fills outputs with NaN, so their log-sum-exps stay NaN (the merge
  # selects them away), while every split below a request's count writes a number or -inf.
  partials = {}
  merge_fn = ta._merge

  def capture(o_part, lse_part, pl_, rows, **kw):
    partials.update(lse=np.asarray(lse_part), splits=pl_.num_splits, counts=kw["live_counts"])
    return merge_fn(o_part, lse_part, pl_, rows, **kw)

  monkeypatch.setattr(ta, "_merge", capture)
  rng = np.random.default_rng(11)
  # 504 columns: 8 tiles (the last one partial) and so 8 launched splits, a multiple of 8 (no
  # padded copy); twice the pool and the splits ran this the same way at twice the cost.
  batch, q_len, cache_len = 3, 9, 504
  slots, _, visibility, valid = random_window(rng, batch, q_len, cache_len)
  prefix_len = jnp.asarray([40, 150, 400], jnp.int32)  # + 9: 1, 3 and 7 tiles
  options = ta.Options(form=form, merge=merge, live_splits=True)
  if groups:  # MHA: 2 KV groups of 4 query heads, separate V tiles
    dim = 64
    q = jnp.asarray(rng.standard_normal((batch, q_len, 4 * groups, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch + 2, cache_len, groups, dim)), jnp.float32)
            for _ in range(2))
    got = ta.mha_tree_attention(q, k, v, slots, prefix_len, visibility, valid, scale=0.125,
                                interpret=INTERPRET, partial_dtype="float32", options=options)
    want = mha_reference(bf16(q), bf16(k), bf16(v), slots, prefix_len, visibility, valid, scale=0.125)
  else:
    q_lat, q_rope = (rng.standard_normal((batch, q_len, 2, d)).astype(np.float32) for d in (128, 32))
    c_kv, k_pe = (rng.standard_normal((batch + 2, cache_len, d)).astype(np.float32) for d in (128, 32))
    args = [jnp.asarray(x) for x in (q_lat, q_rope, c_kv, k_pe)]
    got = ta.mla_tree_attention(*args, slots, prefix_len, visibility, valid, scale=0.1,
                                interpret=INTERPRET, partial_dtype="float32", options=options)
    want = mla_reference(*map(bf16, args), slots, prefix_len, visibility, valid, scale=0.1)
  check_no_races()
  assert_matches(np.asarray(got), np.asarray(want), np.asarray(valid))
  per_request = np.repeat([1, 3, 7], max(groups, 1))  # bg = b * G + g
  assert partials["splits"] == 8
  np.testing.assert_array_equal(np.asarray(partials["counts"]), per_request)
  lse = partials["lse"]
  for bg, count in enumerate(per_request):
    assert not np.isnan(lse[bg, :count]).any(), bg
    assert np.isnan(lse[bg, count:]).all(), bg


def test_pdl_marks_both_kernels_for_dependent_launch():
  # Options(pdl=True), lowered for cuda at Kimi's widths: the attention and the merge kernel each
  # start by waiting for the kernels before them and are marked for a PDL launch; the default
  # lowers neither. A 1k pool, as in test_rows_m_register_counts_lower_for_cuda: 16 splits for the
  # merge kernel's unrolled loop rather than 44.
  sds = jax.ShapeDtypeStruct
  args = (sds((1, 17, 8, 512), jnp.bfloat16), sds((1, 17, 8, 64), jnp.bfloat16),
          sds((2, 1024, 512), jnp.bfloat16), sds((2, 1024, 64), jnp.bfloat16),
          sds((1,), jnp.int32), sds((1,), jnp.int32), sds((1, 17, 17), jnp.bool_), sds((1, 17), jnp.bool_))

  def lowered(options):
    f = functools.partial(ta.mla_tree_attention, scale=0.1, options=options)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  on, off = lowered(ta.Options(pdl=True)), lowered(ta.Options())
  assert "tree_attention_merge" in on
  for marker in ("mosaic_gpu.uses_pdl", "griddepcontrol.wait", "griddepcontrol.launch_dependents"):
    assert on.count(marker) == 2 and marker not in off, marker


def test_live_splits_lower_for_cuda_and_need_matching_metadata():
  # At Kimi's widths both forms and both merges pass Mosaic GPU's lowering with the per-request
  # counts; metadata prepared without them is refused by a call that uses them. A 1k pool, not
  # 32k: the merge kernel is unrolled over the launched splits (130 at 32k for one node, 5 s of
  # lowering alone); 1k still launches 11 to 16 splits, the merge kernel in three of the four.
  sds = jax.ShapeDtypeStruct
  for b, q, merge in ((1, 17, "auto"), (2, 9, "auto"), (4, 17, "pairwise"), (1, 1, "auto")):
    args = (sds((b, q, 8, 512), jnp.bfloat16), sds((b, q, 8, 64), jnp.bfloat16),
            sds((2, 1024, 512), jnp.bfloat16), sds((2, 1024, 64), jnp.bfloat16),
            sds((b,), jnp.int32), sds((b,), jnp.int32), sds((b, q, q), jnp.bool_), sds((b, q), jnp.bool_))
    f = functools.partial(ta.mla_tree_attention, scale=0.1,
                          options=ta.Options(live_splits=True, merge=merge))
    assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  window = random_window(np.random.default_rng(4), 2, 17, 300)
  kw = dict(heads=8, latent_dim=512, rope_dim=64, cache_len=300)
  meta = ta.prepare_mla_window(*window, **kw, options=ta.Options(live_splits=False))
  live = ta.prepare_mla_window(*window, **kw, options=ta.Options(live_splits=True))
  assert dict(meta.layout)["live_splits"] == 0 and dict(live.layout)["live_splits"] > 0
  q = jnp.zeros((2, 17, 8, 512), jnp.bfloat16), jnp.zeros((2, 17, 8, 64), jnp.bfloat16)
  pools = jnp.zeros((4, 300, 512), jnp.bfloat16), jnp.zeros((4, 300, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="live_splits 0 \\(prepared\\) != "):
    ta.mla_tree_attention(*q, *pools, *window, scale=0.1, window_meta=meta,
                          options=ta.Options(live_splits=True))
  # The default, "auto": on for this batch of 2 (so the default call refuses the meta prepared
  # without counts), off for one request, or for one launched split.
  assert dict(ta.prepare_mla_window(*window, **kw).layout)["live_splits"] > 0
  with pytest.raises(ValueError, match="live_splits 0 \\(prepared\\) != "):
    ta.mla_tree_attention(*q, *pools, *window, scale=0.1, window_meta=meta)
  one = [x[:1] for x in window]
  assert dict(ta.prepare_mla_window(*one, **kw).layout)["live_splits"] == 0
  assert dict(ta.prepare_mla_window(*window, **kw, num_splits=1).layout)["live_splits"] == 0
  with pytest.raises(ValueError, match="live_splits must be True, False or 'auto'"):
    ta.prepare_mla_window(*window, **kw, options=ta.Options(live_splits="on"))


def test_window_mask_bits_unpack_to_window_mask():
  rng = np.random.default_rng(3)
  for q_len in (1, 31, 32, 33, 65):
    visibility = jnp.asarray(rng.random((2, q_len, q_len)) < 0.5)
    valid = jnp.asarray(rng.random((2, q_len)) < 0.7)
    words = np.asarray(tree_lib.window_mask_bits(visibility, valid)).view(np.uint32)
    assert words.shape == (2, q_len, -(-q_len // 32))
    cols = np.arange(q_len)
    unpacked = (words[:, :, cols // 32] >> (cols % 32).astype(np.uint32)) & 1
    np.testing.assert_array_equal(unpacked.astype(bool),
                                  np.asarray(tree_lib.window_mask(visibility, valid)))
    # Bits past Q are zero.
    spare = words.shape[-1] * 32 - q_len
    if spare:
      assert not (words[:, :, -1] >> np.uint32(32 - spare)).any()


def test_plan_table():
  # Kimi (R=512), form "rows_n": warpgroup 1 alone holds O^T of a 48-row tile (192 registers per
  # thread); 48 rows fit shared memory beside two 73.7 KB KV stages, so 8 heads x 17 nodes = 136
  # rows take 3 tiles (the fewest), and 72 rows (Q=9) take 2 of 40.
  rows_n = ta.Options(form="rows_n")
  kimi = ta.plan(q_len=17, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512,
                 shared_value=True, cache_len=32768, options=rows_n)
  assert (kimi.rows_per_tile, kimi.num_row_tiles, kimi.value_wgs, kimi.form) == (48, 3, 2, "rows_n")
  assert kimi.options.pv == "value_wg"
  for regs in ((250, 250), (232, 240), (100,)):  # not a multiple of 8 / over 504 in all / one count
    with pytest.raises(ValueError, match="Options.regs"):
      ta.plan(q_len=17, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512, shared_value=True,
              cache_len=32768, options=ta.Options(regs=regs, form="rows_n"))
  # Form "rows_m" takes register counts too (the default 232 and 232 spill in warpgroup 0 at
  # Kimi widths); the same 504 limit holds (counts summing to 512 hung the H200).
  rows_m = ta.plan(q_len=17, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512,
                   shared_value=True, cache_len=32768, options=ta.Options(regs=(256, 208), form="rows_m"))
  assert (rows_m.form, rows_m.options.regs) == ("rows_m", (256, 208))
  with pytest.raises(ValueError, match="Options.regs"):
    ta.plan(q_len=17, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512, shared_value=True,
            cache_len=32768, options=ta.Options(regs=(256, 216), form="rows_m"))
  # By default ("auto") 136 rows take the 64-row form: 3 tiles, 2 KV stages (2 x 73.7 KB and
  # the 73.7 KB query tile: the planner's estimate is the whole 227 KiB), 3 warpgroups, no
  # reduction scratch.
  auto = ta.plan(q_len=17, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512,
                 shared_value=True, cache_len=32768)
  assert (auto.form, auto.rows_per_tile, auto.num_row_tiles, auto.num_stages) == ("rows_m", 64, 3, 2)
  assert (auto.options.pv, auto.reduction_scratch, auto.rows_stored) == ("split", 0, 64)
  assert ta._smem_bytes_rows_m(576, 0, 1, 2) <= ta.SMEM_LIMIT < ta._smem_bytes_rows_m(576, 0, 1, 3)
  with pytest.raises(ValueError, match="rows_m"):  # Dv 64: no two halves of whole wgmma tiles
    ta.plan(q_len=17, heads_per_group=4, num_work=2, key_dims=(64,), value_dim=64,
            shared_value=False, cache_len=4096, options=ta.Options(form="rows_m"))
  with pytest.raises(ValueError, match="128 registers"):  # a fourth warpgroup: ptxas gives 128
    ta.plan(q_len=17, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512,
            shared_value=True, cache_len=32768, options=ta.Options(form="rows_m", pv="value_wg"))
  assert kimi.swizzle == 128 and kimi.num_stages == 2 and kimi.num_splits * 3 >= 100
  # One cross-warp reduction round per max (6 KiB of scratch still fits) and the lazy softmax sum.
  assert kimi.reduction_scratch == 48 * 128 and kimi.options.lazy_sum
  assert ta._smem_bytes(48, 576, 0, 1, 2, kimi.reduction_scratch) <= ta.SMEM_BUDGET
  nine = ta.plan(q_len=9, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512,
                 shared_value=True, cache_len=32768)
  assert (nine.rows_per_tile, nine.num_row_tiles, nine.form) == (40, 2, "rows_n")  # 72 < 80 rows
  # Batch 8 with long trees: several waves of splits rather than one split per request.
  long_trees = ta.plan(q_len=33, heads_per_group=8, num_work=8, key_dims=(512, 64),
                       value_dim=512, shared_value=True, cache_len=131072)
  assert long_trees.num_splits > 1
  # One node with 8 heads: one tile, and only the 8 live rows of O^T are written.
  decode = ta.plan(q_len=1, heads_per_group=8, num_work=1, key_dims=(512, 64), value_dim=512,
                   shared_value=True, cache_len=32768)
  assert (decode.num_row_tiles, decode.rows_stored) == (1, 8)
  # The demo model (R=128): wider tiles fit (390 rows in 3 of 136), and more pipeline stages.
  demo = ta.plan(q_len=65, heads_per_group=6, num_work=1, key_dims=(128, 32), value_dim=128,
                 shared_value=True, cache_len=4096)
  assert (demo.rows_per_tile, demo.num_row_tiles, demo.num_stages) == (136, 3, 4)
  assert demo.form == "rows_n"  # "auto": 64-row tiles would need 7
  assert not demo.options.lazy_sum  # a third [64, 136] array would not fit warpgroup 0's registers
  # Head width 64 (the drafter's MHA): Dv / 2 is not a whole wgmma tile, so one value warpgroup.
  mha = ta.plan(q_len=17, heads_per_group=4, num_work=2, key_dims=(64,), value_dim=64,
                shared_value=False, cache_len=4096)
  assert mha.value_wgs == 1


def test_bad_inputs_raise_clear_errors():
  q = jnp.zeros((1, 3, 2, 64), jnp.float32)
  qr = jnp.zeros((1, 3, 2, 32), jnp.float32)
  c_kv = jnp.zeros((2, 100, 64), jnp.float32)
  k_pe = jnp.zeros((2, 100, 32), jnp.float32)
  window = (jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.ones((1, 3, 3), bool),
            jnp.ones((1, 3), bool))
  with pytest.raises(ValueError, match="q_rope"):
    ta.mla_tree_attention(q, qr[:, :2], c_kv, k_pe, *window, scale=1.0)
  with pytest.raises(ValueError, match="pools"):
    ta.mla_tree_attention(q, qr, c_kv[..., :32], k_pe, *window, scale=1.0)
  with pytest.raises(ValueError, match="visibility"):
    ta.mla_tree_attention(q, qr, c_kv, k_pe, *window[:2], window[2][:, :2], window[3], scale=1.0)
  with pytest.raises(TypeError, match="valid must be bool"):
    ta.mla_tree_attention(q, qr, c_kv, k_pe, *window[:3], window[3].astype(jnp.int32), scale=1.0)
  with pytest.raises(TypeError, match="c_kv"):
    ta.mla_tree_attention(q, qr, c_kv.astype(jnp.int32), k_pe, *window, scale=1.0)
  with pytest.raises(ValueError, match="not a multiple of kv heads"):
    ta.mha_tree_attention(jnp.zeros((1, 3, 3, 64)), jnp.zeros((2, 100, 2, 64)),
                          jnp.zeros((2, 100, 2, 64)), *window, scale=1.0)
  with pytest.raises(ValueError, match="no kv heads"):
    ta.mha_tree_attention(jnp.zeros((1, 3, 3, 64)), jnp.zeros((2, 100, 0, 64)),
                          jnp.zeros((2, 100, 0, 64)), *window, scale=1.0)
  with pytest.raises(ValueError, match="T is 0"):
    ta.mla_tree_attention(q, qr, c_kv[:, :0], k_pe[:, :0], *window, scale=1.0)
  for splits in (0, -1, 2.0):
    with pytest.raises(ValueError, match=f"num_splits={splits!r} must be an int >= 1"):
      ta.mla_tree_attention(q, qr, c_kv, k_pe, *window, scale=1.0, num_splits=splits)
  with pytest.raises(TypeError, match="scale must be a finite Python float .* got JitTracer"):
    jax.jit(lambda s: ta.mla_tree_attention(q, qr, c_kv, k_pe, *window, scale=s))(1.0)
  with pytest.raises(TypeError, match="interpret must be None"):
    ta.mla_tree_attention(q, qr, c_kv, k_pe, *window, scale=1.0, interpret="cpu")
  # Slots and lengths out of range, where concrete (under jit they are the caller's precondition):
  # the kernel would give zeros for a slot past the pool, or attend its padding past T.
  for slot in (2, -1):
    with pytest.raises(ValueError, match=f"slots\\[0\\] = {slot} is not a slot of the pool's 2"):
      ta.mla_tree_attention(q, qr, c_kv, k_pe, jnp.array([slot]), *window[1:], scale=1.0)
  for prefix, message in ((98, "puts its real window row 2 past the pool's 100 columns"), (-1, "is negative")):
    with pytest.raises(ValueError, match=f"prefix_len\\[0\\] = {prefix} {message}"):
      ta.mha_tree_attention(jnp.zeros((1, 3, 2, 64)), jnp.zeros((2, 100, 1, 64)), jnp.zeros((2, 100, 1, 64)),
                            window[0], jnp.array([prefix]), *window[2:], scale=1.0)
  padded = ta.mla_tree_attention(q, qr, c_kv, k_pe, window[0], jnp.array([98]), window[2],
                                 jnp.zeros((1, 3), bool), scale=1.0, interpret=True)  # no real rows: allowed
  assert not np.asarray(padded).any()
  with pytest.raises(ValueError, match="reduction_scratch must be 0 .* got 1000"):
    ta.mla_tree_attention(q, qr, c_kv, k_pe, *window, scale=1.0, options=ta.Options(reduction_scratch=1000))
  with pytest.raises(ValueError, match="reduction_scratch=1048576 does not fit"):
    ta.mla_tree_attention(q, qr, c_kv, k_pe, *window, scale=1.0, options=ta.Options(reduction_scratch=2**20))
  with pytest.raises(ValueError, match="kv_heads is 0"):
    ta.prepare_mha_window(*window, heads=2, kv_heads=0, head_dim=64, cache_len=100)
  with pytest.raises(ValueError, match="num_splits=0 must be an int >= 1"):
    ta.prepare_mla_window(*window, heads=2, latent_dim=64, rope_dim=32, cache_len=100, num_splits=0)
  # Empty batches, windows and head axes give empty results, as the reference does.
  for b, q_len, heads in ((0, 3, 2), (1, 0, 2), (1, 3, 0)):
    empty = (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b, q_len, q_len), bool),
             jnp.ones((b, q_len), bool))
    got = ta.mla_tree_attention(jnp.zeros((b, q_len, heads, 64)), jnp.zeros((b, q_len, heads, 32)), c_kv, k_pe,
                                *empty, scale=1.0)
    assert got.shape == (b, q_len, heads, 64) == mla_reference(
        jnp.zeros((b, q_len, heads, 64)), jnp.zeros((b, q_len, heads, 32)), c_kv, k_pe, *empty, scale=1.0).shape


def test_model_switch_selects_the_kernel_only_on_a_gpu():
  assert kimi._attention_impl(KimiConfig(attention_impl="xla")) is reference.mla_tree_attention
  if jax.default_backend() == "gpu":
    assert kimi._attention_impl(KimiConfig(attention_impl="pallas")) is ta.mla_tree_attention
  else:
    with pytest.raises(RuntimeError, match="needs a GPU backend"):
      kimi._attention_impl(KimiConfig(attention_impl="pallas"))
  # Under the interpreter forced for tests, as moe_impl="pallas" is.
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    assert kimi._attention_impl(KimiConfig(attention_impl="pallas")) is ta.mla_tree_attention
