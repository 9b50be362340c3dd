"""The Kimi target model against an independent float64 numpy forward, and its window semantics.

All tests run the tiny config in float32 on the CPU.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cache as cache_lib
from models import forward as fwd
from models import hf_io, int4, kimi
from models.config import ConfigError, KimiConfig
from tests.models import numpy_kimi

CFG = KimiConfig.tiny()
MAX_LEN = 128
# float32 model vs float64 reference: observed about 2e-6 absolute on logits of magnitude ~3.
ATOL = 2e-4


@pytest.fixture(scope="module")
def model():
  return kimi.init_model(CFG, seed=0)


@pytest.fixture(scope="module")
def state_dict(model):
  return hf_io.to_hf_state_dict(model)


def new_cache(num_slots=3):
  return cache_lib.init_cache(CFG, num_slots, MAX_LEN)


_verify = jax.jit(fwd.verify, static_argnames=("feature_layers",))
_commit = jax.jit(fwd.commit)


def prefill_all(model, prompts, slots, cache, chunk_size=16):
  _, logits, features, cache = fwd.prefill(model, prompts, slots, cache, chunk_size=chunk_size,
                                           all_logits=True, feature_layers=(0, 1, 2))
  return np.asarray(logits), np.asarray(features), cache


def sequential_logits(model, tokens):
  """Logits after each token, decoding one token per step."""
  cache = new_cache(1)
  step = jax.jit(fwd.decode_step)
  out = []
  for t in tokens:
    logits, _, cache = step(model, jnp.asarray([t], jnp.int32), jnp.asarray([0], jnp.int32), cache)
    out.append(np.asarray(logits[0]))
  return np.stack(out)


def random_tree(rng, q_len, num_real):
  """Random parents (parents before children) for the first num_real rows; the rest padding."""
  parents = np.full(q_len, -1)
  for i in range(1, num_real):
    parents[i] = rng.integers(0, i)
  depth = np.zeros(q_len, np.int64)
  vis = np.eye(q_len, dtype=bool)
  for i in range(1, num_real):
    depth[i] = depth[parents[i]] + 1
    vis[i] = vis[parents[i]]
    vis[i, i] = True
  return parents, depth, vis


def path_to(parents, node):
  path = [node]
  while parents[path[-1]] >= 0:
    path.append(parents[path[-1]])
  return path[::-1]


# ---------------------------------------------------------------------------------------------
def test_tiny_exercises_yarn_and_router_bias(model):
  assert CFG.rope_factor > 1 and CFG.rope_cos_sin_scale != 1.0
  bias = np.asarray(model.moe_layers.mlp.e_score_correction_bias[...])
  assert np.abs(bias).min() > 0


def test_prefill_matches_independent_float64_reference(model, state_dict):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.vocab_size, 70)  # positions past 32 exercise YaRN's interpolation
  ref, hidden = numpy_kimi.forward(state_dict, CFG, tokens, return_hidden=True)
  logits, features, _ = prefill_all(model, [tokens], [0], new_cache(1), chunk_size=32)
  np.testing.assert_allclose(logits[0, :70], ref, atol=ATOL, rtol=0)
  for layer in range(CFG.num_hidden_layers):  # feature l is the output of decoder layer l
    np.testing.assert_allclose(features[0, :70, layer], hidden[layer], atol=ATOL, rtol=0)
  # Expert load counts only real rows (the last chunk is padded) and matches the reference.
  cache = new_cache(1)
  out, _ = fwd.prefill_chunk(model, jnp.asarray(np.pad(tokens, (0, 10))[None], jnp.int32),
                             jnp.asarray([70]), jnp.asarray([0]), cache)
  np.testing.assert_array_equal(np.asarray(out.expert_load), numpy_kimi.expert_load(state_dict, CFG, tokens))


def test_latent_norms_take_their_own_eps():
  """q_a_layernorm and kv_a_layernorm use ``latent_norm_eps`` (1e-6 in DeepSeek-V3's modeling code
  whatever rms_norm_eps says), the other norms rms_norm_eps. An eps as large as the latents' mean
  square makes a mix-up show far above the tolerance."""
  cfg = CFG.replace(latent_norm_eps=0.25)
  model = kimi.init_model(cfg, seed=0)
  state = hf_io.to_hf_state_dict(model)
  tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, 20)
  ref = numpy_kimi.forward(state, cfg, tokens)
  mixed_up = numpy_kimi.forward(state, cfg.replace(latent_norm_eps=cfg.rms_norm_eps), tokens)
  assert np.abs(ref - mixed_up).max() > 50 * ATOL
  logits, _, _ = prefill_all(model, [tokens], [0], new_cache(1), chunk_size=32)
  np.testing.assert_allclose(logits[0, :20], ref, atol=ATOL, rtol=0)


def test_prefill_equals_token_by_token_decoding_and_any_chunk_size(model):
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, CFG.vocab_size, 37)
  seq = sequential_logits(model, tokens)
  for chunk in (5, 16, 64):
    logits, _, _ = prefill_all(model, [tokens], [0], new_cache(1), chunk_size=chunk)
    np.testing.assert_allclose(logits[0, :37], seq, atol=1e-4, rtol=0)


def test_prefill_chunk_past_the_pool_keeps_every_row_finite(model):
  # A 66-token prompt in chunks of 64 in a 70-column pool: the second chunk's window runs past the
  # pool (its write is dropped). Its padded rows past the pool see nothing; their logits and
  # features reach the drafter, which must be able to ignore them, so they must be finite.
  prompt = np.random.default_rng(3).integers(0, CFG.vocab_size, 66)
  last, logits, features, _ = fwd.prefill(model, [prompt], [0], cache_lib.init_cache(CFG, 1, 70), chunk_size=64,
                                          all_logits=True, feature_layers=(0,))
  assert np.isfinite(np.asarray(logits)).all() and np.isfinite(np.asarray(features)).all()
  seq = sequential_logits(model, prompt)
  np.testing.assert_allclose(np.asarray(logits)[0, :66], seq, atol=1e-4, rtol=0)


def test_prefill_batch_of_different_lengths_and_slots(model):
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, CFG.vocab_size, n) for n in (3, 29, 17)]
  last, logits, _, cache = fwd.prefill(model, prompts, [2, 0, 1], new_cache(3), chunk_size=8, all_logits=True)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [29, 17, 3, 0])
  for i, prompt in enumerate(prompts):
    alone, _, _ = prefill_all(model, [prompt], [0], new_cache(1), chunk_size=8)
    np.testing.assert_allclose(np.asarray(logits)[i, :len(prompt)], alone[0, :len(prompt)], atol=1e-5)
    np.testing.assert_allclose(np.asarray(last)[i], alone[0, len(prompt) - 1], atol=1e-5)


def test_verify_chain_equals_sequential_decoding(model):
  rng = np.random.default_rng(3)
  prefix = rng.integers(0, CFG.vocab_size, 20)
  chain = rng.integers(0, CFG.vocab_size, 9)
  _, _, cache = prefill_all(model, [prefix], [0], new_cache(1))
  q = len(chain)
  logits, _, _, _ = _verify(model, jnp.asarray(chain[None], jnp.int32), jnp.asarray(20 + np.arange(q))[None],
                            jnp.asarray(np.tril(np.ones((q, q), bool))[None]), jnp.ones((1, q), bool),
                            jnp.asarray([0]), cache)
  seq = sequential_logits(model, np.concatenate([prefix, chain]))
  np.testing.assert_allclose(np.asarray(logits[0]), seq[20:], atol=1e-4, rtol=0)


def test_verify_branched_tree_each_node_equals_its_path(model, state_dict):
  rng = np.random.default_rng(4)
  prefix = rng.integers(0, CFG.vocab_size, 40)
  q = 17
  parents, depth, vis = random_tree(rng, q, q)
  tokens = rng.integers(0, CFG.vocab_size, q)
  _, _, cache = prefill_all(model, [prefix], [0], new_cache(1))
  logits, _, _, _ = _verify(model, jnp.asarray(tokens[None], jnp.int32), jnp.asarray(40 + depth[None], jnp.int32),
                            jnp.asarray(vis[None]), jnp.ones((1, q), bool), jnp.asarray([0]), cache)
  for node in range(q):
    path = np.concatenate([prefix, tokens[path_to(parents, node)]])
    ref = numpy_kimi.forward(state_dict, CFG, path)[-1]
    np.testing.assert_allclose(np.asarray(logits[0, node]), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_padding_fuzz_real_rows_unchanged_no_nan_no_expert_load(model, seed):
  rng = np.random.default_rng(100 + seed)
  q = 16
  b = 2
  prefixes = [rng.integers(0, CFG.vocab_size, n) for n in rng.integers(5, 40, b)]
  _, _, cache = prefill_all(model, prefixes, [0, 1], new_cache(2))
  num_real = rng.integers(1, q, b)
  tokens, positions, vis, valid = [], [], [], []
  for i in range(b):
    parents, depth, v = random_tree(rng, q, num_real[i])
    tok = rng.integers(0, CFG.vocab_size, q)
    pos = len(prefixes[i]) + depth
    pad = np.arange(q) >= num_real[i]
    tok[pad] = 0  # token 0 is a real id: padding is known only from `valid`
    pos[pad] = rng.integers(0, 10_000, pad.sum())  # garbage positions in padded rows
    v[pad] = rng.random((pad.sum(), q)) < 0.5  # garbage visibility in padded rows ...
    v[:, pad] |= rng.random((q, pad.sum())) < 0.5  # ... and padded columns marked visible
    tokens.append(tok), positions.append(pos), vis.append(v), valid.append(~pad)
  args = [jnp.asarray(np.stack(x)) for x in (tokens, positions, vis, valid)]
  args[0] = args[0].astype(jnp.int32)
  args[1] = args[1].astype(jnp.int32)
  logits, _, _, load = _verify(model, *args, jnp.asarray([0, 1]), cache)
  logits = np.asarray(logits)
  assert np.isfinite(logits).all()
  total_load = np.zeros_like(np.asarray(load))
  for i in range(b):
    n = num_real[i]
    # The same tree without padding, alone in its batch.
    sub = [jnp.asarray(x[i][None, :n]) for x in (tokens, positions, valid)]
    sub_vis = jnp.asarray(vis[i][None, :n, :n])
    ref, _, _, ref_load = _verify(model, sub[0].astype(jnp.int32), sub[1].astype(jnp.int32), sub_vis, sub[2],
                                  jnp.asarray([i]), cache)
    np.testing.assert_allclose(logits[i, :n], np.asarray(ref[0]), atol=1e-5, rtol=0)
    total_load += np.asarray(ref_load)
  np.testing.assert_array_equal(np.asarray(load), total_load)


def test_commit_then_continue_equals_sequential_and_slots_are_isolated(model):
  rng = np.random.default_rng(5)
  prefixes = [rng.integers(0, CFG.vocab_size, n) for n in (12, 25)]
  _, _, cache = prefill_all(model, prefixes, [0, 1], new_cache(2))
  q = 9
  trees = [random_tree(rng, q, q) for _ in range(2)]
  tokens = rng.integers(0, CFG.vocab_size, (2, q))
  positions = np.stack([len(p) + t[1] for p, t in zip(prefixes, trees)])
  vis = np.stack([t[2] for t in trees])
  _, _, cache, _ = _verify(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                           jnp.asarray(vis), jnp.ones((2, q), bool), jnp.asarray([0, 1]), cache)
  # Accept the path to the deepest node in each tree.
  paths = [path_to(t[0], int(np.argmax(t[1]))) for t in trees]
  accepted = np.zeros((2, q), np.int32)
  for i, path in enumerate(paths):
    accepted[i, :len(path)] = path
  cache = _commit(cache, jnp.asarray([0, 1]), jnp.asarray(accepted), jnp.asarray([len(p) for p in paths]))
  np.testing.assert_array_equal(np.asarray(cache.lengths)[:2], [len(p) + len(a) for p, a in zip(prefixes, paths)])
  # Continue decoding both requests, batched, then compare each with plain sequential decoding.
  cont = rng.integers(0, CFG.vocab_size, (2, 4))
  step = jax.jit(fwd.decode_step)
  got = []
  for t in range(4):
    logits, _, cache = step(model, jnp.asarray(cont[:, t], jnp.int32), jnp.asarray([0, 1]), cache)
    got.append(np.asarray(logits))
  got = np.stack(got, axis=1)
  for i in range(2):
    full = np.concatenate([prefixes[i], tokens[i][paths[i]], cont[i]])
    seq = sequential_logits(model, full)
    np.testing.assert_allclose(got[i], seq[-4:], atol=1e-4, rtol=0)


# 30 s of op-by-op compilation; the default run's eager-against-compiled check is the engine's
# (tests/ddtree_jax/test_engine.py::test_jit_and_disable_jit_give_identical_tokens), which runs
# these prefill and verify forwards under jax.disable_jit() inside whole decoding steps.
@pytest.mark.slow
def test_jit_and_disable_jit_agree(model):
  rng = np.random.default_rng(6)
  prompt = rng.integers(0, CFG.vocab_size, 11)
  q = 5
  parents, depth, vis = random_tree(rng, q, 4)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, q)), jnp.int32)
  args = (tokens, jnp.asarray(11 + depth[None], jnp.int32), jnp.asarray(vis[None]),
          jnp.asarray(np.arange(q)[None] < 4), jnp.asarray([0]))

  def run(jit):
    _, _, _, cache = fwd.prefill(model, [prompt], [0], new_cache(1), chunk_size=8, jit=jit)
    call = _verify if jit else fwd.verify
    logits, _, cache, _ = call(model, *args, cache)
    return np.asarray(logits), np.asarray(cache.c_kv)

  jit_logits, jit_cache = run(True)
  with jax.disable_jit():
    eager_logits, eager_cache = run(False)
  np.testing.assert_allclose(jit_logits, eager_logits, atol=1e-5, rtol=0)
  np.testing.assert_allclose(jit_cache, eager_cache, atol=1e-5, rtol=0)


def test_k2_6_parameter_count_without_allocation():
  abstract = kimi.abstract_model(KimiConfig.k2_6())
  leaf = abstract.moe_layers.mlp.experts_gate.get_value()
  assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.shape == (60, 384, 7168, 2048)
  # Untied embeddings, no MTP layer; e_score_correction_bias (60 x 384) included.
  assert kimi.param_count(abstract) == 1_026_408_232_448


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_inputs_raise_before_compute(model):
  cache = new_cache(2)
  pool = cache_lib.SlotPool(2, MAX_LEN)
  slot = pool.allocate()
  ok = dict(tree_tokens=jnp.zeros((1, 4), jnp.int32), positions=jnp.zeros((1, 4), jnp.int32),
            visibility=jnp.ones((1, 4, 4), bool), valid=jnp.ones((1, 4), bool), slots=jnp.asarray([slot]))
  with pytest.raises(ValueError, match="visibility has shape"):
    fwd.verify(model, **{**ok, "visibility": jnp.ones((1, 4, 3), bool)}, cache=cache)
  with pytest.raises(ValueError, match="valid must be bool"):
    fwd.verify(model, **{**ok, "valid": jnp.ones((1, 4), jnp.int32)}, cache=cache)
  with pytest.raises(ValueError, match="unknown slot 7"):
    fwd.verify(model, **{**ok, "slots": jnp.asarray([7])}, cache=cache)
  with pytest.raises(cache_lib.CacheError, match="slot 1 is not allocated"):
    fwd.verify(model, **{**ok, "slots": jnp.asarray([1])}, cache=cache, pool=pool)
  pool.record_commit([slot], [MAX_LEN - 2])
  with pytest.raises(cache_lib.CacheError, match="does not fit slot 0: 126 committed \\+ 4 > max_len 128"):
    fwd.verify(model, **ok, cache=cache, pool=pool)
  with pytest.raises(ValueError, match="feature layer 3 outside"):
    fwd.verify(model, **ok, cache=cache, feature_layers=(3,))
  with pytest.raises(ValueError, match="empty prompt"):
    fwd.prefill(model, [[1, 2], []], [0, 1], cache)
  with pytest.raises(ValueError, match="outside \\[0, 256\\)"):
    fwd.prefill(model, [[1, 256]], [0], cache)
  pool2 = cache_lib.SlotPool(2, 16)
  s = pool2.allocate()
  with pytest.raises(cache_lib.CacheError, match="prompt 0 of 20 tokens does not fit slot 0"):
    fwd.prefill(model, [list(range(20))], [s], cache, pool=pool2)
  with pytest.raises(cache_lib.CacheError, match="no free cache slot"):
    pool2.allocate(), pool2.allocate()


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    (dict(qk_rope_head_dim=7), "must be even"),
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(rope_factor=0.5), "rope_factor"),
    (dict(attention_impl="cuda"), "attention_impl"),
    (dict(moe_impl="pallas"), "moe_impl='pallas' computes in bfloat16, so a float32 model"),
    (dict(n_group=8, topk_group=4), "group-limited routing"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace=4"),
    (dict(eos_token_id=999), "eos_token_id=999 outside"),
    (dict(n_shared_experts=1.5), "n_shared_experts must be an int"),
    (dict(first_k_dense_replace=True), "first_k_dense_replace must be an int"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(norm_topk_prob=1), "norm_topk_prob must be true or false"),
    (dict(routed_scaling_factor=True), "routed_scaling_factor must be > 0"),
])
def test_invalid_config_is_named(change, message):
  with pytest.raises(ConfigError, match=message):
    KimiConfig.tiny(**change)


def test_config_from_hf_plain_and_multimodal():
  real = KimiConfig.k2_6()
  hf = real.to_hf()
  assert KimiConfig.from_hf(hf, dtype=real.dtype, param_dtype=real.param_dtype) == real
  wrapped = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": hf, "vision_config": {}}
  assert KimiConfig.from_hf(wrapped) == KimiConfig.from_hf(hf)
  with pytest.raises(ConfigError, match="lacks"):
    KimiConfig.from_hf({"hidden_size": 8})
  # K2.6's INT4 experts are read (tests/models/test_int4.py); an incomplete scheme is refused.
  with pytest.raises(ConfigError, match="format=None: expected 'pack-quantized'"):
    KimiConfig.from_hf({**hf, "quantization_config": {"quant_method": "compressed-tensors"}})
  int4_real = KimiConfig.k2_6(experts_int4=True)
  assert KimiConfig.from_hf({**wrapped, "quantization_config": int4_real.to_hf()["quantization_config"]},
                            dtype=real.dtype, param_dtype=real.param_dtype) == int4_real
  with pytest.raises(ConfigError, match="only 'yarn'"):
    KimiConfig.from_hf({**hf, "rope_scaling": {"type": "linear", "factor": 2.0}})
  # DeepSeek-V3's code builds no shared expert where n_shared_experts is null; absent, the default (1).
  assert KimiConfig.from_hf({**hf, "n_shared_experts": None}).n_shared_experts == 0
  assert KimiConfig.from_hf({k: v for k, v in hf.items() if k != "n_shared_experts"}).n_shared_experts == 1


def test_config_from_hf_latent_eps_and_transformers_v5_rope_parameters():
  """A DeepSeek/Kimi checkpoint's config.json has no latent_norm_eps: its latent norms run at the
  modeling code's 1e-6 beside rms_norm_eps 1e-5. transformers v5 writes YaRN as rope_parameters
  (theta inside); it must read as the rope_scaling form does, never as plain RoPE."""
  real = KimiConfig.k2_6()
  hf = {k: v for k, v in real.to_hf().items() if k != "latent_norm_eps"}
  read = KimiConfig.from_hf(hf, dtype=real.dtype, param_dtype=real.param_dtype)
  assert (read.latent_norm_eps, read.rms_norm_eps) == (1e-6, 1e-5) and read == real
  assert KimiConfig.from_hf(KimiConfig.demo().to_hf()).latent_norm_eps == 1e-5  # ours round-trip
  v5 = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
  v5["rope_parameters"] = dict(hf["rope_scaling"], rope_type="yarn", rope_theta=hf["rope_theta"])
  del v5["rope_parameters"]["type"]
  assert KimiConfig.from_hf(v5, dtype=real.dtype, param_dtype=real.param_dtype) == real
  assert real.rope_factor == 64 and real.softmax_scale != KimiConfig.k2_6(rope_factor=1.0).softmax_scale
  plain = KimiConfig.from_hf({**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
  assert (plain.rope_factor, plain.rope_theta) == (1.0, 10000.0)
  with pytest.raises(ConfigError, match="rope_scaling .* and rope_parameters .* disagree"):
    KimiConfig.from_hf({**hf, "rope_parameters": dict(v5["rope_parameters"], factor=32.0)})
  with pytest.raises(ConfigError, match="rope_scaling .* and rope_parameters .* disagree"):
    KimiConfig.from_hf({**hf, "rope_parameters": {"rope_type": "default"}})
  with pytest.raises(ConfigError, match="rope_theta=50000.0 and rope_parameters.rope_theta=10000.0 disagree"):
    KimiConfig.from_hf({**hf, "rope_parameters": dict(v5["rope_parameters"], rope_theta=10000.0)})
  assert KimiConfig.from_hf({**hf, "rope_parameters": v5["rope_parameters"]}, dtype=real.dtype,
                            param_dtype=real.param_dtype) == real  # both, agreeing
  implicit = {k: v for k, v in v5["rope_parameters"].items() if k not in ("beta_fast", "beta_slow")}
  assert (hf["rope_scaling"]["beta_fast"], hf["rope_scaling"]["beta_slow"]) != (32, 1)  # K2.6's are not the defaults
  assert KimiConfig.from_hf({**hf, "rope_scaling": dict(hf["rope_scaling"], beta_fast=32, beta_slow=1),
                             "rope_parameters": implicit}).rope_beta_fast == 32  # defaults agree with values
  typeless = KimiConfig.from_hf({**v5, "rope_parameters": {"rope_theta": 5e5}})  # v5 may leave plain RoPE's type out
  assert (typeless.rope_factor, typeless.rope_theta) == (1.0, 5e5)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": "yarn"}, "rope_scaling must be a dict, got 'yarn'"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}, "rope_scaling lacks factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters type 'linear'"),
    ({"rope_parameters": "yarn"}, "rope_parameters must be a dict"),
    ({"latent_norm_eps": 0}, "latent_norm_eps must be > 0"),
    ({"rope_scaling": {"type": "yarn", "factor": "x", "original_max_position_embeddings": 4096}},
     "rope_scaling.factor must be a number, got 'x'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096.5}},
     "original_max_position_embeddings must be an int"),
    ({"eos_token_id": []}, "eos_token_id is an empty list"),
    ({"eos_token_id": "0"}, "eos_token_id must be an int"),
    ({"n_shared_experts": "1"}, "n_shared_experts must be an int, got '1'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2: only 1"),  # would make every other layer dense
    ({"hidden_act": "gelu"}, "hidden_act='gelu': only 'silu'"),
])
def test_malformed_hf_config_values_are_config_errors(change, message):
  """A config.json value of the wrong kind is a ConfigError naming the key, never a raw KeyError or
  TypeError, and never silently taken (a truthy string would tie the embeddings)."""
  with pytest.raises(ConfigError, match=message):
    KimiConfig.from_hf({**KimiConfig.tiny().to_hf(), **change})


def test_routed_block_matches_a_float64_loop_and_zeroes_rows_routed_nowhere():
  """``routed_block`` (what the model's MoE and ``benchmarks/bench_moe.py`` run): each token is the
  weighted sum of its experts' SwiGLU outputs; an id of E (padding, or an expert held elsewhere
  under expert parallelism) contributes nothing, and a token routed nowhere comes out zero."""
  rng = np.random.default_rng(3)
  m, k, e, h, i = 5, 3, 6, 8, 4
  tokens = rng.standard_normal((m, h)).astype(np.float32)
  ids = np.stack([rng.permutation(e + 1)[:k] for _ in range(m)]).astype(np.int32)  # E appears in some rows
  ids[2] = e  # token 2: routed nowhere
  ids[4, 0] = -1  # any id outside [0, E) is routed nowhere too (bincount folded -1 into expert 0)
  weights = rng.random((m, k)).astype(np.float32)
  gate, up, down = (rng.standard_normal(s).astype(np.float32) * 0.5 for s in ((e, h, i), (e, h, i), (e, i, h)))
  out, sizes = kimi.routed_block(jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(weights),
                                 int4.Bf16Experts(*map(jnp.asarray, (gate, up, down))))
  want = np.zeros((m, h))
  for t in range(m):
    for j in range(k):
      ex = ids[t, j]
      if 0 <= ex < e:
        g, u = tokens[t] @ gate[ex].astype(np.float64), tokens[t] @ up[ex].astype(np.float64)
        want[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[ex])
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)
  assert not np.asarray(out)[2].any()
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(np.where(ids < 0, e, ids).reshape(-1), minlength=e + 1)[:e])
  with pytest.raises(ValueError, match="moe_impl='triton'"):
    kimi.routed_block(jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(weights),
                      int4.Bf16Experts(*map(jnp.asarray, (gate, up, down))), "triton")


def test_routed_block_lowers_without_a_float_scatter_add_for_the_gpu():
  """On the GPU the combine is ``gather_add_rows`` (no float scatter-add: XLA's adds a token's rows
  with atomics there, in an order that changes from run to run); on the CPU ``scatter_add_rows``.
  Checked on the programs lowered for each platform (no GPU needed; the combine is the same code
  for both ``moe_impl``, and the Pallas path cannot be lowered for the GPU here)."""
  m, k, e, h, i = 3, 2, 4, 16, 16
  experts = int4.Bf16Experts(*(jnp.zeros(s, jnp.bfloat16) for s in ((e, h, i), (e, h, i), (e, i, h))))
  args = (jnp.zeros((m, h), jnp.bfloat16), jnp.zeros((m, k), jnp.int32), jnp.zeros((m, k)))

  def float_scatter_adds(platform):
    block = jax.jit(lambda x, ids, w: kimi.routed_block(x, ids, w, experts, "xla"))
    text = block.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return re.findall(r'"stablehlo.scatter"[^\n]*\n\s*\^bb0\(%\w+: tensor<(?:f|bf)\d+>', text), text

  cpu, cpu_text = float_scatter_adds("cpu")
  cuda, text = float_scatter_adds("cuda")
  assert cpu, "the CPU program should hold the scatter-add (else this check detects nothing)"
  assert not cuda
  # The rows' orderings: lax.sort on the CPU, pairwise ranks on the GPU (``MOE_ORDER_MAX_PAIRWISE``).
  assert "stablehlo.sort" in cpu_text and "stablehlo.sort" not in text


def test_gather_add_rows_equals_the_scatter_add_and_is_batch_invariant():
  """The GPU's combine against the CPU's and a float64 sum, with rows routed nowhere: each token's
  rows are added in sorted (expert) order, the scatter-add's order, so without fusion (eager) the
  two agree bit for bit with a sequential float32 sum in that order; and a token's output is bit
  for bit the same when the batch holds only it, or the tokens come in reverse."""
  rng = np.random.default_rng(5)
  m, k, e, h = 6, 3, 5, 40
  ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
  ids[2, 1] = ids[4, 0] = ids[4, 2] = e  # rows routed nowhere (an expert held elsewhere)
  weights = rng.random((m, k)).astype(np.float32)
  rows_by_slot = rng.standard_normal((m, k, h)).astype(np.float32) * 10.0 ** rng.integers(-3, 4, (m, k, 1))

  def combine(fn, tokens, jit=True):
    flat = ids[tokens].reshape(-1)
    order = np.argsort(flat, kind="stable")
    t_rows = rows_by_slot[tokens].reshape(-1, h)[order]
    routed = np.arange(len(flat)) < np.sum(flat < e)
    call = functools.partial(fn, k=k)
    args = (jnp.asarray(t_rows, jnp.bfloat16), jnp.asarray(order // k),
            jnp.asarray(weights[tokens].reshape(-1)[order]), jnp.asarray(routed))
    if jit:
      return np.asarray(jax.jit(call)(*args))
    with jax.disable_jit():
      return np.asarray(call(*args))

  every = np.arange(m)
  got = combine(kimi.gather_add_rows, every)
  bf16_rows = np.asarray(jnp.asarray(rows_by_slot, jnp.bfloat16), np.float32)
  want = np.einsum("mk,mkh->mh", np.where(ids < e, weights, 0.0).astype(np.float64), bf16_rows)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  sequential = np.zeros((m, h), np.float32)  # expert order, each product rounded, then added
  for t in range(m):
    for j in np.argsort(ids[t], kind="stable"):
      if ids[t, j] < e:
        sequential[t] = sequential[t] + bf16_rows[t, j] * weights[t, j]
  np.testing.assert_array_equal(combine(kimi.gather_add_rows, every, jit=False), sequential)
  np.testing.assert_array_equal(combine(kimi.scatter_add_rows, every, jit=False), sequential)
  for t in (0, 2, 4):
    np.testing.assert_array_equal(combine(kimi.gather_add_rows, np.array([t]))[0], got[t])
  np.testing.assert_array_equal(combine(kimi.gather_add_rows, every[::-1])[::-1], got)


def test_a_verify_step_writes_the_cache_in_place_without_copying_a_layers_pool():
  """The layer scan writes each layer's window into the whole cache and attends its slots there:
  the compiled step (XLA:CPU, float32) holds no copy, dynamic-slice or fusion that produces a
  layer's pool [S + 1, T, D] or the whole cache, whose cost would grow with every slot and column
  of the pool at every layer and step (the form that passed ``c_kv[layer_id]`` did both: the demo
  target's batch-1 step took 14 -> 179 ms from 1 slot x 1024 columns to 16 x 4096)."""
  cfg = KimiConfig.tiny()
  model = kimi.init_model(cfg, seed=0)
  slots_total, max_len, q_len = 10, 72, 3  # sizes no other array of the step has
  cache = cache_lib.init_cache(cfg, slots_total, max_len)

  def step(model, cache, tokens, positions, slots):
    visibility = jnp.broadcast_to(jnp.tril(jnp.ones((q_len, q_len), bool)), (1, q_len, q_len))
    return fwd.verify(model, tokens, positions, visibility, jnp.ones((1, q_len), bool), slots, cache)[2]

  args = (cache, jnp.zeros((1, q_len), jnp.int32), jnp.arange(q_len, dtype=jnp.int32)[None], jnp.asarray([2]))
  text = jax.jit(step, donate_argnums=1).lower(model, *args).compile().as_text()
  layers, rows = cache.c_kv.shape[:2]
  one_layer, whole = set(), set()  # a layer's pool; the whole cache (its in-place updates have it too)
  for d in (cache.c_kv.shape[-1], cache.k_pe.shape[-1]):
    one_layer |= {f"[{rows},{max_len},{d}]", f"[1,{rows},{max_len},{d}]"}
    whole |= {f"[{layers * rows},{max_len},{d}]", f"[{layers},{rows},{max_len},{d}]"}
  copied = []
  for line in text.splitlines():
    made = re.search(r"= f32(\[[0-9,]+\])\S* ([a-z-]+)\(", line)
    if made and ((made.group(1) in one_layer and made.group(2) in ("copy", "dynamic-slice", "fusion"))
                 or (made.group(1) in whole and made.group(2) == "copy")):
      copied.append(line.strip()[:160])
  assert not copied, copied
  # The check can see such arrays: the whole cache's shape is in the program (the in-place updates).
  assert any(shape in text for shape in whole)
