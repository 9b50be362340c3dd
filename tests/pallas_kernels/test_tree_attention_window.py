"""Window metadata built once per step (``prepare_mla_window`` / ``prepare_mha_window``), the
single-split merge, and the model's hoisting of the metadata out of its layer scan (CPU, GPU
interpret mode for the kernel).

A precomputed ``WindowMeta`` must give bit for bit what the one-call path gives, a meta built for
other shapes must raise a ``ValueError`` naming the mismatch, and the model must build it once per
forward and give the same logits as with per-call metadata.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cache as cache_lib
from models import forward as fwd
from models import kimi
from models.config import KimiConfig
from pallas_kernels import reference
from pallas_kernels import tree_attention as ta
from tests.pallas_kernels.test_tree_attention import (INTERPRET, assert_matches, bf16,
                                                       check_no_races, mla_reference,
                                                       random_window)


def mla_inputs(rng, *, batch, q_len, heads, latent, rope, cache_len):
  window = random_window(rng, batch, q_len, cache_len)
  args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (
      (batch, q_len, heads, latent), (batch, q_len, heads, rope), (batch + 2, cache_len, latent),
      (batch + 2, cache_len, rope))]
  return args, window


@pytest.mark.parametrize("form,q_len,heads,num_splits,live_splits", [
    ("auto", 9, 2, 3, False), ("rows_m", 17, 4, 1, False), ("auto", 9, 2, None, True)])
def test_mla_precomputed_meta_is_bit_identical(form, q_len, heads, num_splits, live_splits):
  # Cache length 203 (padded to 208 inside): the meta is built for the padded pool, as the call
  # pads it. One split: the merge is skipped, so this also runs that path against the reference.
  # With live_splits the meta also carries each request's split count (4 launched here).
  rng = np.random.default_rng(11 + q_len)
  args, window = mla_inputs(rng, batch=2, q_len=q_len, heads=heads, latent=128, rope=32,
                            cache_len=203)
  options = ta.Options(form=form, live_splits=live_splits)
  call = functools.partial(ta.mla_tree_attention, *args, *window, scale=0.09, interpret=INTERPRET,
                           num_splits=num_splits, options=options)
  one_call = np.asarray(call())
  check_no_races()
  meta = ta.prepare_mla_window(*window, heads=heads, latent_dim=128, rope_dim=32, cache_len=203,
                               num_splits=num_splits, options=options)
  assert dict(meta.layout)["padded cache_len"] == 208
  precomputed = np.asarray(call(window_meta=meta))
  check_no_races()
  np.testing.assert_array_equal(precomputed, one_call)
  # And under jit with the meta as an argument (a pytree whose layout is static), against the
  # jitted one-call path (jit fuses the merge, so it rounds differently from eager).
  jitted = jax.jit(lambda m: call(window_meta=m))(meta)
  np.testing.assert_array_equal(np.asarray(jitted), np.asarray(jax.jit(call)()))
  want = mla_reference(*map(bf16, args), *window, scale=0.09)
  assert_matches(precomputed, np.asarray(want), np.asarray(window[3]))


def test_mha_precomputed_meta_is_bit_identical():
  rng = np.random.default_rng(21)
  batch, q_len, heads, groups, dim, cache_len = 2, 9, 6, 2, 64, 150
  window = random_window(rng, batch, q_len, cache_len)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (
      (batch, q_len, heads, dim), (batch + 2, cache_len, groups, dim),
      (batch + 2, cache_len, groups, dim)))
  call = functools.partial(ta.mha_tree_attention, q, k, v, *window, scale=0.125,
                           interpret=INTERPRET, num_splits=2)
  one_call = np.asarray(call())
  meta = ta.prepare_mha_window(*window, heads=heads, kv_heads=groups, head_dim=dim,
                               cache_len=cache_len, num_splits=2)
  np.testing.assert_array_equal(np.asarray(call(window_meta=meta)), one_call)
  check_no_races()


def test_mismatched_meta_raises_naming_the_mismatch():
  # The check runs before the kernel: no kernel call here.
  rng = np.random.default_rng(3)
  args, window = mla_inputs(rng, batch=2, q_len=9, heads=2, latent=128, rope=32, cache_len=203)
  call = functools.partial(ta.mla_tree_attention, *args, *window, scale=0.1, interpret=INTERPRET)
  prep = functools.partial(ta.prepare_mla_window, heads=2, latent_dim=128, rope_dim=32,
                           cache_len=203)
  with pytest.raises(ValueError, match=r"padded cache_len 304 \(prepared\) != 208"):
    call(window_meta=prep(*window, cache_len=300))
  with pytest.raises(ValueError, match=r"heads_per_group 4 \(prepared\) != 2"):
    call(window_meta=prep(*window, heads=4))
  other = random_window(rng, 2, 5, 203)  # another q_len (and so another visibility width)
  with pytest.raises(ValueError, match=r"q_len 5 \(prepared\) != 9"):
    call(window_meta=prep(*other))
  one = tuple(x[:1] for x in window)  # another batch
  with pytest.raises(ValueError, match=r"batch 1 \(prepared\) != 2"):
    call(window_meta=prep(*one))
  # Another plan (the 64-row form) means other row tiles.
  with pytest.raises(ValueError, match=r"rows_per_tile 64 \(prepared\) != 24"):
    call(window_meta=prep(*window, options=ta.Options(form="rows_m")))
  with pytest.raises(TypeError, match="WindowMeta"):
    call(window_meta=prep(*window).meta)
  good = prep(*window)
  with pytest.raises(ValueError, match="window_meta.meta must be int32"):
    call(window_meta=ta.WindowMeta(meta=good.meta[:, :, :1], layout=good.layout))
  with pytest.raises(ValueError, match="window_meta.meta must be int32"):
    call(window_meta=ta.WindowMeta(meta=good.meta.astype(jnp.float32), layout=good.layout))
  # Batch 2: live splits by default, so the meta carries the merge's counts, taken out of the
  # array once (the column the kernel reads); a meta without them, or with them where the call
  # runs without live splits, is refused.
  num_words = good.meta.shape[2] - 2
  np.testing.assert_array_equal(np.asarray(good.split_counts),
                                np.asarray(good.meta[:, 0, 1 + num_words, 3]))
  assert good.split_counts.dtype == jnp.int32 and good.split_counts.min() >= 1
  with pytest.raises(ValueError, match=r"split_counts must be int32\[2\] with live splits .*, got None"):
    call(window_meta=ta.WindowMeta(meta=good.meta, layout=good.layout))
  off = prep(*window, options=ta.Options(live_splits=False))
  assert off.split_counts is None
  with pytest.raises(ValueError, match="split_counts must be None without live splits"):
    call(window_meta=dataclasses.replace(off, split_counts=good.split_counts),
         options=ta.Options(live_splits=False))
  with pytest.raises(ValueError, match=r"num_groups 2 \(prepared\) != 1"):  # an MHA meta
    call(window_meta=ta.prepare_mha_window(*window, heads=4, kv_heads=2, head_dim=64,
                                           cache_len=203))
  with pytest.raises(ValueError, match="visibility"):  # the window is checked when preparing
    prep(window[0], window[1], window[2][:, :3], window[3])


def test_meta_for_other_widths_or_pool_length_raises():
  # Widths and pool lengths that leave the row tiles and the padded pool unchanged (so the meta
  # array itself would be the same) are still another call's shapes: they must raise, as the
  # docstrings promise, not pass silently. No kernel call here.
  rng = np.random.default_rng(4)
  args, window = mla_inputs(rng, batch=2, q_len=9, heads=2, latent=128, rope=32, cache_len=203)
  call = functools.partial(ta.mla_tree_attention, *args, *window, scale=0.1, interpret=INTERPRET)
  prep = functools.partial(ta.prepare_mla_window, *window, heads=2, latent_dim=128, rope_dim=32,
                           cache_len=203)
  with pytest.raises(ValueError, match=r"latent_dim 64 \(prepared\) != 128"):
    call(window_meta=prep(latent_dim=64))
  with pytest.raises(ValueError, match=r"rope_dim 64 \(prepared\) != 32"):
    call(window_meta=prep(rope_dim=64))
  with pytest.raises(ValueError, match=r"cache_len 205 \(prepared\) != 203"):
    call(window_meta=prep(cache_len=205))  # both pad to 208
  # MHA: another head width (both pad to 64).
  q, k, v = (jnp.zeros(s, jnp.float32) for s in ((2, 9, 4, 64), (4, 203, 2, 64), (4, 203, 2, 64)))
  mha = functools.partial(ta.mha_tree_attention, q, k, v, *window, scale=0.1, interpret=INTERPRET)
  with pytest.raises(ValueError, match=r"head_dim 48 \(prepared\) != 64"):
    mha(window_meta=ta.prepare_mha_window(*window, heads=4, kv_heads=2, head_dim=48,
                                          cache_len=203))
  # An MLA meta in an MHA call with one K/V head (same rows and groups): another kind of call.
  q1, k1 = jnp.zeros((2, 9, 2, 128), jnp.float32), jnp.zeros((4, 203, 1, 128), jnp.float32)
  with pytest.raises(ValueError, match=r"head_dim None \(prepared\) != 128"):
    ta.mha_tree_attention(q1, k1, k1, *window, scale=0.1, interpret=INTERPRET,
                          window_meta=prep(rope_dim=32))


def test_single_split_merge_is_the_partial_bit_for_bit():
  # With one split the merge is skipped; the general merge must give exactly the same values
  # (weight 2^(lse - lse) = 1; rows that saw nothing have lse -inf and zero partials).
  rng = np.random.default_rng(8)
  bg, n_rt, rt, dv = 2, 3, 16, 8
  o = rng.standard_normal((bg, 1, n_rt, rt, dv)).astype(np.float32)
  lse = (rng.standard_normal((bg, 1, n_rt, rt)) * 30).astype(np.float32)
  lse[1, 0, 2, 5:] = -np.inf
  o[1, 0, 2, 5:] = 0.0
  rows = n_rt * rt - 5
  for dtype, merge in [(jnp.float32, "kernel"), (jnp.bfloat16, "kernel"),
                       (jnp.float32, "pairwise"), (jnp.bfloat16, "pairwise")]:
    pl_ = ta.Plan(rows_per_tile=rt, num_row_tiles=n_rt, swizzle=128, num_stages=2, num_splits=1,
                  rows_stored=rt, reduction_scratch=0, value_wgs=1,
                  options=ta.Options(merge=merge))
    args = (jnp.asarray(o, dtype), jnp.asarray(lse), pl_, rows)
    skipped = np.asarray(ta._merge(*args))
    merged = np.asarray(ta._merge(*args, skip_single=False, interpret=INTERPRET))
    assert skipped.dtype == np.float32 and skipped.shape == (bg, rows, dv)
    np.testing.assert_array_equal(skipped, merged, err_msg=merge)
    np.testing.assert_array_equal(skipped, np.asarray(jnp.asarray(o, dtype), np.float32)
                                  .reshape(bg, n_rt * rt, dv)[:, :rows])
  # The skip leaves no merge kernels: nothing but a slice and a convert in the jaxpr.
  jaxpr = jax.make_jaxpr(lambda a, b: ta._merge(a, b, pl_, rows))(jnp.asarray(o), jnp.asarray(lse))
  assert not {e.primitive.name for e in jaxpr.eqns} & {"reduce_sum", "exp2", "reduce_max"}


# ---------------------------------------------------------------------------------------------
# The model: metadata built once per forward, outside the layer scan.
CFG = KimiConfig.tiny(attention_impl="pallas")


@pytest.fixture(scope="module")
def pallas_model():
  return kimi.init_model(CFG, seed=0)


def verify_inputs(rng, batch=2, q_len=9, max_len=64):
  """A random filled cache (committed lengths 20 and 37) and a padded random tree window."""
  cache = cache_lib.init_cache(CFG, batch, max_len)
  lengths = np.zeros(batch + 1, np.int32)
  lengths[:batch] = [20, 37][:batch]
  cache = cache_lib.KVCache(
      c_kv=jnp.asarray(rng.standard_normal(cache.c_kv.shape), cache.c_kv.dtype),
      k_pe=jnp.asarray(rng.standard_normal(cache.k_pe.shape), cache.k_pe.dtype),
      lengths=jnp.asarray(lengths))
  slots, _, visibility, valid = random_window(rng, batch, q_len, max_len)
  slots = jnp.arange(batch, dtype=jnp.int32)
  depth = np.asarray(visibility).sum(-1) - 1
  positions = jnp.asarray(lengths[:batch, None] + depth, jnp.int32)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (batch, q_len)), jnp.int32)
  return tokens, positions, visibility, valid, slots, cache


def run_verify(model, inputs):
  logits, _, cache, _ = fwd.verify(model, *inputs)
  return np.asarray(logits), np.asarray(cache.c_kv)


def test_model_builds_the_meta_once_and_passes_it_to_every_layer(pallas_model, monkeypatch):
  # The model's plumbing, with a stand-in for the kernel: it checks that every layer receives the
  # step's metadata and that it equals what the call would build itself (layout at trace time,
  # values in the graph: a mismatch turns the layer's output to NaN), then attends with the
  # plain-jnp reference. (The kernel is not interpreted here: the multi-warpgroup interpreter run
  # inside the model's jitted layer scan deadlocked on the 2-core CPU, once in a CI run and once
  # in four ad hoc runs. That a precomputed meta gives the kernel's one-call result bit for bit is
  # tested above, at top level.)
  real_meta, real_prepare = ta._window_meta, ta.prepare_mla_window
  calls = {"window_meta": 0, "prepare": 0}
  received = []

  def counting_meta(*a, **k):
    calls["window_meta"] += 1
    return real_meta(*a, **k)

  def counting_prepare(*a, **k):
    calls["prepare"] += 1
    return real_prepare(*a, **k)

  def checking_attention(q_latent, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid, *, scale,
                         window_meta=None):
    out = reference.mla_tree_attention(q_latent, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid,
                                       scale=scale)
    received.append(window_meta is not None)
    if window_meta is None:
      return out
    with monkeypatch.context() as m:  # the call's own metadata, not counted
      m.setattr(ta, "_window_meta", real_meta)
      own = real_prepare(slots, prefix_len, visibility, valid, heads=q_latent.shape[2],
                         latent_dim=q_latent.shape[3], rope_dim=q_rope.shape[3], cache_len=c_kv.shape[1])
    assert window_meta.layout == own.layout
    return jnp.where(jnp.all(window_meta.meta == own.meta), out, jnp.nan)

  monkeypatch.setattr(kimi, "_attention_impl", lambda cfg: checking_attention)
  monkeypatch.setattr(ta, "_window_meta", counting_meta)
  monkeypatch.setattr(ta, "prepare_mla_window", counting_prepare)
  inputs = verify_inputs(np.random.default_rng(0))
  hoisted, hoisted_cache = run_verify(pallas_model, inputs)
  # Once per forward: not once per traced layer body (a dense and a MoE stack here), and every
  # traced layer body received it.
  assert calls == {"window_meta": 1, "prepare": 1}
  assert received == [True, True]
  assert np.isfinite(hoisted).all()
  # The same forward with the reference alone: the stand-in changed nothing but checked.
  with monkeypatch.context() as m:
    m.setattr(kimi, "_attention_impl", lambda cfg: reference.mla_tree_attention)
    m.setattr(kimi, "_attention_window", lambda *a, **k: None)
    xla, xla_cache = run_verify(pallas_model, inputs)
  np.testing.assert_array_equal(hoisted, xla)
  np.testing.assert_array_equal(hoisted_cache, xla_cache)


def test_model_meta_check_can_fail(pallas_model, monkeypatch):
  # The stand-in's check above is live: a model that passed another window's metadata (prefix
  # lengths off by one) gives NaN logits through it.
  real_attention_window = kimi._attention_window

  def wrong_window(cfg, window, *a, **k):
    return real_attention_window(cfg, dataclasses.replace(window, prefix_len=window.prefix_len + 1), *a, **k)

  def checking_attention(q_latent, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid, *, scale,
                         window_meta=None):
    out = reference.mla_tree_attention(q_latent, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid,
                                       scale=scale)
    own = ta.prepare_mla_window(slots, prefix_len, visibility, valid, heads=q_latent.shape[2],
                                latent_dim=q_latent.shape[3], rope_dim=q_rope.shape[3], cache_len=c_kv.shape[1])
    return jnp.where(jnp.all(window_meta.meta == own.meta), out, jnp.nan)

  monkeypatch.setattr(kimi, "_attention_impl", lambda cfg: checking_attention)
  monkeypatch.setattr(kimi, "_attention_window", wrong_window)
  logits, _ = run_verify(pallas_model, verify_inputs(np.random.default_rng(0)))
  assert np.isnan(logits).all()


def test_model_xla_path_takes_no_meta_and_is_unchanged(monkeypatch):
  # attention_impl="xla": no metadata is built, and the reference is called exactly as before
  # (no window_meta argument).
  cfg = KimiConfig.tiny()
  assert kimi._attention_window(cfg, None, 64, 9) is None
  seen = []
  real = reference.mla_tree_attention

  def spy(*a, **k):
    seen.append(sorted(k))
    return real(*a, **k)

  monkeypatch.setattr(reference, "mla_tree_attention", spy)
  model = kimi.init_model(cfg, seed=0)
  inputs = verify_inputs(np.random.default_rng(1))
  logits, _ = run_verify(model, inputs)
  assert seen and all(k == ["scale"] for k in seen)
  assert np.isfinite(logits).all()
  # (tests/models/test_kimi.py checks these logits against an independent float64 forward.)


def test_engine_allocates_the_kernels_pool_length(pallas_model, monkeypatch):
  # A pool whose length the kernel cannot read (T % 8 != 0 or T < 64: the server's default
  # max_len of 1024 + 33 is one) is padded in every layer's call, a copy of the whole pool; the
  # engine allocates the kernel's length instead. The extra columns are never used: the output
  # equals plain greedy decoding (the kernel stood in for by the reference, as above).
  from ddtree_jax import drafters, engine
  from ddtree_jax.near_tie import greedy_reference
  monkeypatch.setattr(kimi, "_attention_impl",
                      lambda cfg: lambda *a, window_meta=None, **k: reference.mla_tree_attention(*a, **k))
  prompt = np.random.default_rng(8).integers(3, CFG.vocab_size, 9).tolist()
  dec = engine.SpeculativeDecoder(pallas_model, drafters.RandomDrafter(CFG.vocab_size), policy="chain", budgets=(2,),
                                  batch_buckets=(1,), max_len=41, prefill_chunk=16, show_progress=False)
  assert dec.max_len == 41 and dec.target_cache.c_kv.shape[2] == ta.padded_cache_len(41) == 64
  got = dec.generate([prompt], 20, stop_token_ids=[]).tokens
  assert got == greedy_reference(pallas_model, [prompt], 20, 41)[0]
