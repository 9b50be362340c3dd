"""The DFlash drafter: an independent float64 reference, training path = inference path, layer
ids, context cache padding, training, the engine adapter and configuration.

Everything runs float32 on the CPU with ``KimiConfig.tiny()`` as the target.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ddtree_jax import engine
from models import cache as cache_lib
from models import dflash
from models import forward as fwd
from models import hf_io, kimi
from models.config import ConfigError, KimiConfig
from tests.models import numpy_dflash, numpy_kimi
from ddtree_jax.near_tie import check_near_ties, greedy_reference

TARGET_CFG = KimiConfig.tiny()
CFG = dflash.DFlashConfig.tiny(TARGET_CFG)  # block 16, feature layers (0, 1)
# float32 JAX vs float64 numpy: observed about 2e-6 on logits of magnitude ~3.
ATOL = 2e-5

_extend = jax.jit(dflash.extend)
_block_logits = jax.jit(dflash.block_logits)
_train_logits = jax.jit(dflash.train_block_logits)


def make_drafter_model(cfg, seed):
  """A random drafter whose norm weights are not all ones (so a swapped norm cannot hide)."""
  model = dflash.init_dflash(cfg, seed)
  rng = np.random.default_rng(seed + 100)
  for _, variable in nnx.iter_graph(model):
    if isinstance(variable, nnx.Param) and variable.shape[-1:] in ((cfg.hidden_size,), (cfg.head_dim,)) \
        and np.all(np.asarray(variable[...]) == 1.0):
      variable.set_value(jnp.asarray(1.0 + 0.2 * rng.standard_normal(variable.shape), jnp.float32))
  return model


@pytest.fixture(scope="module")
def target():
  return kimi.init_model(TARGET_CFG, 0)


@pytest.fixture(scope="module")
def drafter_model():
  return make_drafter_model(CFG, 1)


def random_features(rng, batch, rows, cfg=CFG):
  return jnp.asarray(rng.standard_normal((batch, rows, cfg.num_features, cfg.hidden_size)), jnp.float32)


def extend_in_chunks(model, cache, slots, features, lengths, chunk=16):
  """Appends features[b, :lengths[b]] to slot b in fixed-size padded chunks (one compile)."""
  features = np.asarray(features)
  total = -(-max(max(lengths), 1) // chunk) * chunk
  padded = np.zeros((features.shape[0], total) + features.shape[2:], np.float32)
  rows = min(features.shape[1], total)
  padded[:, :rows] = features[:, :rows]
  lengths = np.asarray(lengths)
  for c in range(total // chunk):
    num_new = np.clip(lengths - c * chunk, 0, chunk).astype(np.int32)
    positions = (cache.lengths[jnp.asarray(slots)][:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :])
    cache = _extend(model, cache, jnp.asarray(slots, jnp.int32), positions,
                    jnp.asarray(padded[:, c * chunk:(c + 1) * chunk]), jnp.asarray(num_new))
  return cache


# ---------------------------------------------------------------------------------------------
# Independent float64 reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_block_logits_match_independent_float64_reference(target, drafter_model, tied):
  target_model = kimi.init_model(TARGET_CFG.replace(tie_word_embeddings=True), 0) if tied else target
  params = dflash.DFlashDrafter.params(drafter_model, target_model)
  assert (params.lm_head_kernel is None) == tied
  # The drafter shares the target's arrays: the same buffers, not copies.
  assert params.embed_table is target_model.embed_tokens.embedding[...]
  state = dflash.to_hf_state_dict(drafter_model)
  embed = np.asarray(target_model.embed_tokens.embedding[...])
  head = embed if tied else np.asarray(target_model.lm_head.kernel[...]).T

  rng = np.random.default_rng(0)
  drafter = dflash.DFlashDrafter(CFG)
  cache = drafter.init_state(3, 64)
  # Stale rows past a slot's length must stay invisible: fill slot 0, then reset it.
  cache = extend_in_chunks(drafter_model, cache, [0, 2], random_features(rng, 2, 30), [30, 0])
  cache = drafter.reset(params, cache, np.asarray([0], np.int32), None)
  lengths = [23, 9, 0]  # two chunks, one chunk, empty context
  feats = random_features(rng, 3, 23)
  cache = extend_in_chunks(drafter_model, cache, [0, 1, 2], feats, lengths)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [23, 9, 0, 0])
  roots = np.asarray([5, 200, 17], np.int32)
  got = np.asarray(_block_logits(drafter_model, params.embed_table, params.lm_head_kernel, cache,
                                 jnp.asarray([0, 1, 2]), jnp.asarray(roots), jnp.asarray(lengths, jnp.int32)))
  assert got.shape == (3, CFG.block_size - 1, TARGET_CFG.vocab_size)
  for b, n in enumerate(lengths):
    ref = numpy_dflash.block_logits(state, CFG, embed, head, np.asarray(feats[b, :n]), np.arange(n),
                                    int(roots[b]), n)
    np.testing.assert_allclose(got[b], ref, atol=ATOL, rtol=0, err_msg=f"row {b} (context {n})")
  # propose = top-k of the log-softmax, sorted, distinct.
  ids, logprobs = jax.jit(drafter.propose, static_argnums=5)(params, cache, jnp.asarray([0, 1, 2]),
                                                              jnp.asarray(roots), jnp.asarray(lengths), 6)
  ref_lp = jax.nn.log_softmax(got, axis=-1)
  np.testing.assert_array_equal(np.asarray(ids[..., 0]), np.argmax(got, axis=-1))
  np.testing.assert_allclose(np.asarray(logprobs), np.take_along_axis(np.asarray(ref_lp), np.asarray(ids), -1),
                             atol=1e-6)
  assert np.all(np.diff(np.asarray(logprobs), axis=-1) <= 0) and ids.dtype == jnp.int32


def test_hf_state_dict_round_trip_and_published_names(drafter_model):
  state = dflash.to_hf_state_dict(drafter_model)
  assert state["fc.weight"].shape == (CFG.hidden_size, CFG.num_features * CFG.hidden_size)
  assert state["layers.1.self_attn.k_proj.weight"].shape == (CFG.num_key_value_heads * CFG.head_dim,
                                                              CFG.hidden_size)
  assert state["layers.0.self_attn.q_norm.weight"].shape == (CFG.head_dim,)
  assert {"hidden_norm.weight", "norm.weight", "layers.1.mlp.down_proj.weight"} <= set(state)
  loaded = dflash.from_hf_state_dict(CFG, state)
  for a, b in zip(jax.tree.leaves(nnx.state(drafter_model)), jax.tree.leaves(nnx.state(loaded))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(KeyError, match="layers.1.mlp.up_proj.weight"):
    dflash.from_hf_state_dict(CFG, {k: v for k, v in state.items() if k != "layers.1.mlp.up_proj.weight"})
  bad = dict(state, **{"fc.weight": state["fc.weight"][:, :64]})
  with pytest.raises(ValueError, match="fc.weight"):
    dflash.from_hf_state_dict(CFG, bad)


def test_exported_safetensors_reload_to_identical_logits(tmp_path, target, drafter_model):
  from models import loading  # pylint: disable=import-outside-toplevel
  loading.save_dflash(drafter_model, tmp_path, dtype="float32")
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["dflash_config"]["target_layer_ids"] == list(CFG.target_layer_ids)
  reloaded = loading.load_dflash(tmp_path)
  assert reloaded.cfg == CFG
  rng = np.random.default_rng(9)
  features = random_features(rng, 1, 12)
  slots = jnp.asarray([0])
  embed, head = target.embed_tokens.embedding[...], target.lm_head.kernel[...]
  logits = []
  for model in (drafter_model, reloaded):
    cache = extend_in_chunks(model, dflash.init_cache(CFG, 1, 64), slots, features, [12])
    logits.append(np.asarray(_block_logits(model, embed, head, cache, slots, jnp.asarray([5]), jnp.asarray([12]))))
  np.testing.assert_array_equal(logits[0], logits[1])
  # transformers >= 4.56 writes "dtype" for "torch_dtype": still a float32 drafter.
  hf["dtype"] = hf.pop("torch_dtype")
  (tmp_path / "config.json").write_text(json.dumps(hf))
  assert loading.load_dflash(tmp_path).cfg.param_dtype == "float32"
  # A config with fewer layers than the weights is refused by name (it would load and draft badly),
  # unless the override asks for the cut.
  assert CFG.num_hidden_layers > 1
  (tmp_path / "config.json").write_text(json.dumps(dict(hf, num_hidden_layers=CFG.num_hidden_layers - 1)))
  with pytest.raises(loading.CheckpointError, match=r"tensors of the checkpoint are not part of the drafter .*"
                                                    r"layers\.1\.\S+.*num_hidden_layers=1"):
    loading.load_dflash(tmp_path)
  assert loading.load_dflash(tmp_path, num_hidden_layers=1).cfg.num_hidden_layers == 1


# ---------------------------------------------------------------------------------------------
# Training path == inference path
# ---------------------------------------------------------------------------------------------
def test_training_blocks_equal_extend_then_block_logits(target):
  cfg = dflash.DFlashConfig.tiny(TARGET_CFG, block_size=8)
  model = make_drafter_model(cfg, 2)
  params = dflash.DFlashDrafter.params(model, target)
  rng = np.random.default_rng(3)
  seq = 40
  tokens = rng.integers(0, TARGET_CFG.vocab_size, (2, seq)).astype(np.int32)
  feats = random_features(rng, 2, seq, cfg)
  # Anchor 0 (empty context), chunk boundaries and anchors whose blocks run past the end.
  anchors = np.asarray([[0, 7, 16, 38, 39], [3, 17, 32, 39, 12]], np.int32)
  train = np.asarray(_train_logits(model, params.embed_table, params.lm_head_kernel, jnp.asarray(tokens), feats,
                                   jnp.asarray(anchors)))
  assert train.shape == (2, 5, cfg.block_size - 1, TARGET_CFG.vocab_size)
  for a in range(anchors.shape[1]):
    cache = dflash.init_cache(cfg, 2, 64)
    cache = extend_in_chunks(model, cache, [0, 1], feats, anchors[:, a].tolist())
    roots = tokens[np.arange(2), anchors[:, a]]
    infer = _block_logits(model, params.embed_table, params.lm_head_kernel, cache, jnp.asarray([0, 1]),
                          jnp.asarray(roots), jnp.asarray(anchors[:, a]))
    np.testing.assert_allclose(train[:, a], np.asarray(infer), atol=2e-5, rtol=0, err_msg=f"anchors {anchors[:, a]}")
  # A block never sees another block: changing one anchor leaves the others' logits alone.
  moved = anchors.copy()
  moved[:, 1] = [20, 25]
  again = np.asarray(_train_logits(model, params.embed_table, params.lm_head_kernel, jnp.asarray(tokens), feats,
                                   jnp.asarray(moved)))
  np.testing.assert_allclose(again[:, [0, 2, 3, 4]], train[:, [0, 2, 3, 4]], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# Feature layers
# ---------------------------------------------------------------------------------------------
def test_default_target_layer_ids_rule():
  rule = dflash.default_target_layer_ids
  assert rule(61, 5) == (1, 15, 30, 44, 58)  # 1 + i * 57 / 4 = 1, 15.25, 29.5, 43.75, 58
  assert rule(36, 5) == (1, 9, 17, 25, 33)  # the published Qwen3-8B drafter's ids
  assert rule(28, 3) == (1, 13, 25)
  assert rule(61, 1) == (30,)
  assert rule(3, 1) == (1,)
  assert rule(3, 2) == (0, 1)  # 1 + i * (-1): 1, 0 -> sorted
  assert rule(3, 3) == (0, 1)  # 1, 0.5 -> 0, 0: duplicates dropped
  assert rule(4, 3) == (1,)  # span 0: every id is 1
  assert rule(2, 2) == (0, 1)  # 1, -1 -> clamped to 0
  assert rule(1, 3) == (0,)
  assert CFG.target_layer_ids == (0, 1)
  assert dflash.DFlashConfig.for_target(KimiConfig()).target_layer_ids == (1, 15, 30, 44, 58)
  assert dflash.DFlashConfig.tiny(TARGET_CFG, num_hidden_layers=1).target_layer_ids == (1,)


@pytest.mark.parametrize("layer_ids", [(0, 1), (1, 2)])
def test_engine_features_are_the_outputs_of_those_decoder_layers(target, layer_ids):
  drafter = dflash.DFlashDrafter(dflash.DFlashConfig.tiny(TARGET_CFG, target_layer_ids=layer_ids))
  tokens = np.random.default_rng(4).integers(0, TARGET_CFG.vocab_size, 21)
  _, hidden = numpy_kimi.forward(hf_io.to_hf_state_dict(target), TARGET_CFG, tokens, return_hidden=True)
  cache = cache_lib.init_cache(TARGET_CFG, 1, 64)
  _, _, features, _ = fwd.prefill(target, [tokens], [0], cache, chunk_size=16, feature_layers=drafter.feature_layers)
  assert features.shape[2] == len(layer_ids)
  for k, layer in enumerate(layer_ids):  # id l is the output of decoder layer l, not the embedding
    np.testing.assert_allclose(np.asarray(features[0, :21, k]), hidden[layer], atol=2e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Context cache
# ---------------------------------------------------------------------------------------------
def test_extend_never_writes_padded_rows_and_advances_by_num_new(drafter_model):
  rng = np.random.default_rng(5)
  cache = dflash.init_cache(CFG, 3, 32)
  cache = extend_in_chunks(drafter_model, cache, [0, 1, 2], random_features(rng, 3, 6), [6, 3, 0])
  before = jax.tree.map(np.asarray, cache)
  feats = np.asarray(random_features(rng, 3, 8))
  num_new = np.asarray([5, 0, 8], np.int32)
  slots = jnp.asarray([0, 1, 2])
  positions = cache.lengths[slots][:, None] + jnp.arange(8)[None, :]
  clean = feats.copy()
  garbage = feats.copy()
  for b, n in enumerate(num_new):
    clean[b, n:] = 0.0
    garbage[b, n:] = np.where(rng.random(garbage[b, n:].shape) < 0.5, np.nan, 1e6)
  out_clean = jax.tree.map(np.asarray, _extend(drafter_model, cache, slots, positions, jnp.asarray(clean),
                                               jnp.asarray(num_new)))
  out_garbage = jax.tree.map(np.asarray, _extend(drafter_model, cache, slots, positions, jnp.asarray(garbage),
                                                 jnp.asarray(num_new)))
  for name in ("k", "v", "lengths"):
    np.testing.assert_array_equal(getattr(out_garbage, name), getattr(out_clean, name), err_msg=name)
  assert np.isfinite(out_garbage.k).all() and np.isfinite(out_garbage.v).all()
  np.testing.assert_array_equal(out_garbage.lengths, before.lengths + np.append(num_new, 0))
  # Rows before the old length and after the new one are untouched; the new rows are the context
  # K/V of exactly those features.
  k_new, v_new = dflash.context_kv(drafter_model, jnp.asarray(clean), positions)
  for b, n in enumerate(num_new):
    old = int(before.lengths[b])
    np.testing.assert_array_equal(out_garbage.k[:, b, :old], before.k[:, b, :old])
    np.testing.assert_array_equal(out_garbage.k[:, b, old + n:], before.k[:, b, old + n:])
    np.testing.assert_allclose(out_garbage.k[:, b, old:old + n], np.asarray(k_new[:, b, :n]), atol=1e-6)
    np.testing.assert_allclose(out_garbage.v[:, b, old:old + n], np.asarray(v_new[:, b, :n]), atol=1e-6)
  np.testing.assert_array_equal(out_garbage.k[:, 3], before.k[:, 3])  # scratch slot


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def test_adamw_steps_on_train_loss_reduce_it(target):
  model = dflash.init_dflash(CFG, 6)
  params = dflash.DFlashDrafter.params(model, target)
  rng = np.random.default_rng(6)
  tokens = rng.integers(3, TARGET_CFG.vocab_size, (2, 32)).astype(np.int32)
  valid_len = jnp.asarray([32, 27], jnp.int32)
  cache = cache_lib.init_cache(TARGET_CFG, 2, 32)
  _, _, feats, _ = fwd.prefill(target, list(tokens), [0, 1], cache, chunk_size=32,
                               feature_layers=CFG.target_layer_ids)
  anchors = dflash.sample_anchors(jax.random.key(0), valid_len, 4, 32)
  assert int(jnp.max(anchors[1])) <= 25  # at least one target after every anchor
  target_before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(target))]
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, embed, head, tokens, feats, anchors, valid_len):
    loss_fn = lambda m: dflash.train_loss(m, embed, head, tokens, feats, anchors, valid_len)
    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, metrics, grads

  losses = []
  for i in range(8):
    loss, metrics, grads = step(model, optimizer, params.embed_table, params.lm_head_kernel, jnp.asarray(tokens),
                                feats, anchors, valid_len)
    losses.append(float(loss))
    if i == 0:  # the context path learns too: fc and the context projections get gradients
      assert float(jnp.abs(grads["fc"]["kernel"][...]).max()) > 0
      assert float(jnp.abs(grads["layers"]["self_attn"]["k_proj"]["kernel"][...]).max()) > 0
  print(f"train_loss over AdamW steps: {[round(l, 3) for l in losses]}")
  assert losses[-1] < 0.8 * losses[0] and losses[-1] < min(losses[:-1]), losses
  assert metrics["accuracy"].shape == (CFG.block_size - 1,)
  assert int(metrics["num_targets"][-1]) < int(metrics["num_targets"][0])  # late positions masked
  for before, after in zip(target_before, jax.tree.leaves(nnx.state(target))):
    np.testing.assert_array_equal(before, np.asarray(after))  # the target stays frozen


def test_loss_gamma_defaults():
  assert CFG.gamma == 7.0
  assert dflash.DFlashConfig.tiny(TARGET_CFG, block_size=8).gamma == 4.0
  assert dflash.DFlashConfig.tiny(TARGET_CFG, block_size=10).gamma == 5.0
  assert dflash.DFlashConfig.tiny(TARGET_CFG, block_size=12, loss_gamma=6.0).gamma == 6.0
  with pytest.raises(ConfigError, match="no default loss gamma for block_size 12"):
    _ = dflash.DFlashConfig.tiny(TARGET_CFG, block_size=12).gamma


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------
def test_dflash_drafter_in_engine_is_lossless_and_admission_never_compiles(target, drafter_model, monkeypatch):
  drafter = dflash.DFlashDrafter(CFG)
  # Admission empties the slot with the compiled ``reset_slot`` on the device, never through the
  # host protocol's ``reset`` (which would wait for every step in flight).
  monkeypatch.setattr(dflash.DFlashDrafter, "reset", lambda *args: pytest.fail("admission called reset"))
  assert hash(drafter) == hash(dflash.DFlashDrafter(CFG)) and drafter.num_positions == 15
  max_len, max_new = 96, 20
  with pytest.raises(engine.EngineError, match="drafter_params: DFlashDrafter needs drafter_params = "
                                               "DFlashDrafter.params\\(dflash_model, target\\), got NoneType"):
    engine.SpeculativeDecoder(target, drafter, policy="ddtree", budgets=(4,), max_len=max_len, show_progress=False)
  dec = engine.SpeculativeDecoder(target, drafter, dflash.DFlashDrafter.params(drafter_model, target),
                                  policy="ddtree", budgets=(0, 4), batch_buckets=(2,), max_len=max_len,
                                  show_progress=False)
  rng = np.random.default_rng(8)
  prompts = [rng.integers(3, TARGET_CFG.vocab_size, n).tolist() for n in (5, 19)]
  reference = greedy_reference(target, prompts, max_new, max_len)
  compiles = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event.endswith("backend_compile_duration"):
      compiles.append(event)

  for budget in (4, 0):
    result = dec.generate(prompts, max_new, budget=budget, stop_token_ids=[])
    check_near_ties(result.tokens, *reference, dtype="float32", context=f"dflash/ddtree/budget {budget}")
    # The drafter's context holds every committed token, at every budget (0 included).
    np.testing.assert_array_equal(np.asarray(dec.drafter_state.lengths), np.asarray(dec.target_cache.lengths))
    if budget == 4:
      assert max(size for s in result.steps for size in s.tree_size) == 5
      jax.monitoring.register_event_duration_secs_listener(listener)
  jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []  # admission (drafter.reset included) and steps were compiled ahead of time


def test_yarn_drafter_matches_the_reference(target):
  """YaRN RoPE (the published Kimi drafters' rope_scaling): positions past the original window
  interpolate the slow pairs, and cos/sin carry the attention factor. The plain-RoPE logits differ
  far beyond the tolerance, so the YaRN path is what is checked."""
  cfg = CFG.replace(rope_factor=4.0, rope_original_max_position_embeddings=8, rope_beta_fast=8.0,
                    rope_attention_factor=1.3)
  model = make_drafter_model(cfg, 2)
  params = dflash.DFlashDrafter.params(model, target)
  state = dflash.to_hf_state_dict(model)
  embed = np.asarray(target.embed_tokens.embedding[...])
  head = np.asarray(target.lm_head.kernel[...]).T
  feats = random_features(np.random.default_rng(5), 1, 37, cfg)
  cache = extend_in_chunks(model, dflash.DFlashDrafter(cfg).init_state(1, 64), [0], feats, [37])
  got = np.asarray(_block_logits(model, params.embed_table, params.lm_head_kernel, cache, jnp.asarray([0]),
                                 jnp.asarray([11]), jnp.asarray([37], jnp.int32)))[0]
  ref = numpy_dflash.block_logits(state, cfg, embed, head, np.asarray(feats[0]), np.arange(37), 11, 37)
  plain = numpy_dflash.block_logits(state, cfg.replace(rope_factor=1.0), embed, head, np.asarray(feats[0]),
                                    np.arange(37), 11, 37)
  assert np.abs(ref - plain).max() > 50 * ATOL
  np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)


def test_published_kimi_drafter_config_reads_with_yarn():
  """A K2.6 DFlash config.json as published (facts of the public config: 6 layers, block 8 at the
  top level, YaRN factor 64 with mscale = mscale_all_dim = 1)."""
  published = {
      "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168, "num_hidden_layers": 6,
      "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 18432,
      "vocab_size": 163840, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "num_target_layers": 61, "block_size": 8,
      "max_position_embeddings": 262144, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
      "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
      "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
  }
  cfg = dflash.DFlashConfig.from_hf(published)
  assert (cfg.rope_factor, cfg.rope_original_max_position_embeddings, cfg.rope_attention_factor) == (64.0, 4096, 1.0)
  assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (8, (1, 12, 24, 35, 47, 58), 163838)
  cfg.check_target(KimiConfig.k2_6())
  assert dflash.DFlashConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
  # Without mscale and mscale_all_dim, transformers' default amplitude 0.1 ln(64) + 1.
  bare = dict(published, rope_scaling={"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096})
  assert abs(dflash.DFlashConfig.from_hf(bare).rope_attention_factor - (0.1 * np.log(64) + 1)) < 1e-12
  assert dflash.DFlashConfig.from_hf(published, rope_attention_factor=1.416).rope_attention_factor == 1.416


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
def test_config_hf_round_trip_and_published_layout():
  cfg = dflash.DFlashConfig.tiny(TARGET_CFG, loss_gamma=3.0)
  hf = json.loads(json.dumps(cfg.to_hf()))
  assert hf["architectures"] == ["DFlashDraftModel"] and hf["num_target_layers"] == 3
  assert hf["dflash_config"]["target_layer_ids"] == [0, 1] and hf["dflash_config"]["block_size"] == 16
  assert hf["block_size"] == 16  # where the published model code reads it
  assert hf["dflash_config"]["mask_token_id"] == TARGET_CFG.vocab_size - 1
  assert dflash.DFlashConfig.from_hf(hf) == cfg
  # Top-level fields and transformers-5 style rope_parameters are accepted when reading.
  flat = {k: v for k, v in hf.items() if k not in ("dflash_config", "rope_theta")}
  flat.update(target_layer_ids=[1, 2], mask_token_id=7, block_size=8, rope_parameters={"rope_theta": 5e5,
                                                                                        "rope_type": "default"})
  read = dflash.DFlashConfig.from_hf(flat)
  assert (read.target_layer_ids, read.mask_token_id, read.block_size, read.rope_theta) == ((1, 2), 7, 8, 5e5)
  typeless = dict(flat, rope_parameters={"rope_theta": 5e5})  # transformers v5 may leave plain RoPE's type out
  assert dflash.DFlashConfig.from_hf(typeless) == read
  kimi_drafter = dflash.DFlashConfig.for_target(KimiConfig())
  assert (kimi_drafter.num_attention_heads, kimi_drafter.num_key_value_heads,
          kimi_drafter.mask_token_id) == (56, 8, 163839)
  assert dflash.DFlashConfig.from_hf(kimi_drafter.to_hf()) == kimi_drafter


@pytest.mark.parametrize("change, message", [
    (dict(target_layer_ids=(0, 3)), r"id 3 outside \[0, 3\)"),
    (dict(target_layer_ids=(-1,)), r"id -1 outside"),
    (dict(target_layer_ids=(1, 1)), "repeat a layer"),
    (dict(target_layer_ids=()), "non-empty"),
    (dict(mask_token_id=256), r"mask_token_id=256 outside the vocabulary \[0, 256\)"),
    (dict(num_attention_heads=6, num_key_value_heads=4), "not a multiple of num_key_value_heads"),
    (dict(block_size=1), "block_size must be an int >= 2"),
    (dict(head_dim=15), "must be even"),
    (dict(dtype="int8"), "DFlashConfig.dtype"),
    (dict(rope_theta=0.0), "rope_theta must be > 0"),
])
def test_invalid_config_is_named(change, message):
  with pytest.raises(ConfigError, match=message):
    dflash.DFlashConfig.tiny(TARGET_CFG, **change)


def test_bad_hf_configs_and_mismatched_targets_are_named(target, drafter_model):
  hf = CFG.to_hf()
  with pytest.raises(ConfigError, match="architectures"):
    dflash.DFlashConfig.from_hf(dict(hf, architectures=["Qwen3ForCausalLM"]))
  with pytest.raises(ConfigError, match="lacks num_target_layers"):
    dflash.DFlashConfig.from_hf({k: v for k, v in hf.items() if k != "num_target_layers"})
  with pytest.raises(ConfigError, match="sliding-window"):
    dflash.DFlashConfig.from_hf(dict(hf, use_sliding_window=True))
  with pytest.raises(ConfigError, match="rope_scaling type 'linear': only 'yarn'"):
    dflash.DFlashConfig.from_hf(dict(hf, rope_scaling={"rope_type": "linear", "factor": 4.0}))
  with pytest.raises(ConfigError, match="rope_scaling lacks factor"):
    dflash.DFlashConfig.from_hf(dict(hf, rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 8}))
  with pytest.raises(ConfigError, match="rope_theta=10000.0 and rope_parameters.rope_theta=500.0 disagree"):
    dflash.DFlashConfig.from_hf(dict(hf, rope_parameters={"rope_theta": 500.0}))
  with pytest.raises(ConfigError, match="layer_types: layer 1 is 'sliding_attention'"):
    dflash.DFlashConfig.from_hf(dict(hf, layer_types=["full_attention", "sliding_attention"]))
  nested = dict(hf["dflash_config"], block_size=CFG.block_size * 2)
  with pytest.raises(ConfigError, match=f"block_size={CFG.block_size} and dflash_config.block_size="
                                        f"{CFG.block_size * 2} disagree"):
    dflash.DFlashConfig.from_hf(dict(hf, dflash_config=nested))
  other = kimi.abstract_model(TARGET_CFG.replace(hidden_size=32))
  with pytest.raises(ConfigError, match="hidden_size=64 does not match the target's hidden_size=32"):
    dflash.DFlashDrafter.params(drafter_model, other)
  with pytest.raises(ValueError, match=r"expected \[batch, rows, 2, 64\]"):
    dflash.fuse_context(drafter_model, jnp.zeros((1, 3, 3, 64)))
