"""INT4 routed experts (K2.6's compressed-tensors format) in the model, its checkpoints and the engine.

Checkpoints are written in the real format (safetensors; int32 ``weight_packed``, bf16
``weight_scale``, int64 ``weight_shape``; ``quantization_config`` beside ``text_config`` as in K2.6)
by a packer written here from the format's definition, independent of ``models/int4.py``. The
model's INT4 experts through the kernel (interpret mode) are tested in
``tests/pallas_kernels/test_moe.py::test_model_pallas_branch_matches_xla_in_interpret_mode``.
float32 compute unless stated; the INT4 weights are exact bf16 values, so the dense model built
from them computes the same numbers.
"""

import copy
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ddtree_jax import drafters, engine
from ddtree_jax.near_tie import check_near_ties, greedy_reference
from models import hf_io, int4, kimi, loading
from models.config import ConfigError, KimiConfig

CFG = KimiConfig.tiny(experts_int4=True)
PROJ_SHAPES = {"gate_proj": ("hidden_size", "moe_intermediate_size"),
               "up_proj": ("hidden_size", "moe_intermediate_size"),
               "down_proj": ("moe_intermediate_size", "hidden_size")}


def numpy_quantize_and_pack(weight_out_in):
  """float32 [out, in] -> (packed int32 [out, in/8], scale bf16 [out, in/32], bf16(q * scale)).

  Symmetric group-32: scale = max|w| / 7 (rounded to bf16), q = clip(round(w / scale), -8, 7),
  stored as nibble q + 8, eight per int32 word, the lowest nibble first.
  """
  out, k = weight_out_in.shape
  groups = weight_out_in.reshape(out, k // 32, 32)
  scale = (np.abs(groups).max(axis=2) / 7).astype(ml_dtypes.bfloat16)
  s = scale.astype(np.float32)
  q = np.clip(np.round(groups / np.where(s == 0, 1, s)[..., None]), -8, 7).astype(np.int64).reshape(out, k)
  words = np.zeros((out, k // 8), np.int64)
  for c in range(k // 8):
    for j in range(8):
      words[:, c] |= (q[:, 8 * c + j] + 8) << (4 * j)
  packed = words.astype(np.uint32).view(np.int32)
  dequant = (q.astype(np.float32) * np.repeat(s, 32, axis=1)).astype(ml_dtypes.bfloat16).astype(np.float32)
  return packed, scale, dequant


def write_k26_style_checkpoint(directory, cfg_dense: KimiConfig, seed: int):
  """A K2.6-layout checkpoint of a random tiny model: multimodal wrapper (``text_config``,
  ``language_model.`` names), INT4 routed experts, everything else bf16.

  Returns {hf expert name (``...weight``): bf16(q * scale) [out, in] float32} for checking.
  """
  dense = kimi.init_model(cfg_dense, seed=seed)
  rng = np.random.default_rng(seed)
  tensors, expected = {}, {}
  for name, value in hf_io.iter_hf_tensors(dense):
    value = np.asarray(value, np.float32)
    if ".mlp.experts." in name:
      value = value + rng.standard_normal(value.shape).astype(np.float32) * 0.05  # spread the nibbles
      packed, scale, dequant = numpy_quantize_and_pack(value)
      base = "language_model." + name[:-len("weight")]
      tensors[base + "weight_packed"] = packed
      tensors[base + "weight_scale"] = scale
      tensors[base + "weight_shape"] = np.array(value.shape, np.int64)
      expected[name] = dequant
    else:
      keep = name.endswith("e_score_correction_bias")
      tensors["language_model." + name] = value if keep else value.astype(ml_dtypes.bfloat16)
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  text = dict(cfg_dense.to_hf(), torch_dtype="bfloat16")
  config = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text,
            "quantization_config": copy.deepcopy(int4.COMPRESSED_TENSORS_CONFIG), "torch_dtype": "bfloat16"}
  (directory / "config.json").write_text(json.dumps(config))
  return expected


def numpy_quantize(w):
  """float32 [E, K, N] -> (q int32 [E, N, K], scale float32 [E, K / 32, N], exact ties in w / scale):
  scale = bf16(max|w| / 7), q = w / scale rounded half to even in float64, clipped to -8..7."""
  e, k, n = w.shape
  groups = w.reshape(e, k // 32, 32, n)
  scale = (np.abs(groups).max(axis=2) / np.float32(7)).astype(ml_dtypes.bfloat16).astype(np.float32)
  quotient = groups.astype(np.float64) / np.where(scale == 0, 1, scale)[:, :, None, :]
  q = np.clip(np.round(quotient), -8, 7).reshape(e, k, n).transpose(0, 2, 1).astype(np.int32)
  return q, scale, int((np.abs(quotient - np.trunc(quotient)) == 0.5).sum())


def weights_with_ties(rng, shape):
  """bf16-exact float32 weights [E, K, N] where w / scale is exactly n + 0.5 for about half of them:
  per group a scale S with a few significant bits (not a power of two, so a divide rounds), one
  weight 7 S (so scale = max / 7 = S) and the rest k S / 2 for k in -14..14."""
  e, k, n = shape
  step = rng.choice([3, 5, 7, 11, 13, 15], (e, k // 32, 1, n)) * np.float32(2.0 ** -8)
  step[..., :3] *= np.float32(2.0 ** -20)  # small magnitudes: the boundaries scale with them
  halves = rng.integers(-14, 15, (e, k // 32, 32, n)).astype(np.float32) / 2
  halves[:, :, 0, :] = 7
  w = (halves * step).reshape(shape)
  assert (w.astype(ml_dtypes.bfloat16).astype(np.float32) == w).all()
  return w


def test_quantize_int4_matches_numpy_at_exact_ties():
  """``int4.quantize_int4`` (eager and jitted) against a float64 divide and half-to-even rounding,
  bit for bit, on bf16 weights where w / scale is often exactly n + 0.5 (a bf16 checkpoint has
  such ties; a divide one ulp off rounds them away from even), plus an all-zero group."""
  w = weights_with_ties(np.random.default_rng(3), (3, 64, 24))
  w[1, 32:, 5] = 0
  q_want, scale, ties = numpy_quantize(w)
  assert ties > 100  # the case under test occurs
  for quantize in (int4.quantize_int4, jax.jit(int4.quantize_int4)):
    m = quantize(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(m.scale.astype(jnp.float32)), scale)
    np.testing.assert_array_equal(np.asarray(m.q).astype(np.int32), q_want)
  assert (np.asarray(m.q)[1, 5, 32:] == 0).all()


@pytest.mark.gpu
def test_quantize_int4_on_the_gpu_matches_numpy_at_k26_widths():
  """On the GPU, under jit too: XLA there drops a float32 -> bf16 -> float32 round trip inside a
  fusion, which once compared w against the unrounded scale (147583 of 58.7M nibbles wrong)."""
  rng = np.random.default_rng(4)
  for shape in ((2, 7168, 2048), (2, 2048, 7168)):
    w = np.concatenate([weights_with_ties(rng, (1, *shape[1:])),
                        (rng.standard_normal((1, *shape[1:])) * 0.02).astype(ml_dtypes.bfloat16).astype(np.float32)])
    q_want, scale, ties = numpy_quantize(w)
    assert ties > 1_000_000
    for quantize in (int4.quantize_int4, jax.jit(int4.quantize_int4)):
      m = quantize(jnp.asarray(w, jnp.bfloat16))
      np.testing.assert_array_equal(np.asarray(m.scale.astype(jnp.float32)), scale)
      np.testing.assert_array_equal(np.asarray(m.q).astype(np.int32), q_want)


def test_compressed_tensors_packing_matches_the_format():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((3, 40, 64)).astype(np.float32)  # [E, out, in]
  want = [numpy_quantize_and_pack(w[e]) for e in range(3)]
  m = int4.int4_from_compressed_tensors(np.stack([p for p, _, _ in want]), np.stack([s for _, s, _ in want]))
  packed, scale = int4.int4_to_compressed_tensors(m)
  np.testing.assert_array_equal(packed, np.stack([p for p, _, _ in want]))
  np.testing.assert_array_equal(scale.astype(np.float32), np.stack([s for _, s, _ in want]).astype(np.float32))
  # dequantize_int4 gives [E, in, out] = the format's weights transposed.
  np.testing.assert_array_equal(np.asarray(int4.dequantize_int4(m).astype(jnp.float32)),
                                np.swapaxes(np.stack([d for _, _, d in want]), 1, 2))


def test_k26_checkpoint_loads_packed_and_dequantised(tmp_path):
  cfg_dense = KimiConfig.tiny()
  expected = write_k26_style_checkpoint(tmp_path, cfg_dense, seed=5)
  packed_model = loading.load_kimi(tmp_path, dtype="float32")
  assert packed_model.cfg.experts_int4 and packed_model.cfg.param_dtype == "bfloat16"
  mlp = packed_model.moe_layers.mlp
  assert mlp.experts_gate_words.dtype == jnp.uint32 and mlp.experts_gate_scale.dtype == jnp.bfloat16
  weights = mlp.routed_weights()
  for layer in range(cfg_dense.num_moe_layers):
    for proj, m in zip(PROJ_SHAPES, (weights.gate, weights.up, weights.down)):
      one_layer = int4.KernelInt4Matrix(m.words[layer], m.scale[layer], m.in_features)
      got = np.asarray(int4.dequantize_int4(one_layer).astype(jnp.float32))
      hf_layer = layer + cfg_dense.first_k_dense_replace
      for e in range(cfg_dense.n_routed_experts):
        want = expected[f"model.layers.{hf_layer}.mlp.experts.{e}.{proj}.weight"]
        np.testing.assert_array_equal(got[e], want.T, err_msg=f"layer {hf_layer} expert {e} {proj}")
  # The same checkpoint into a model with dense experts: dequantised on load, same logits.
  dense_model = loading.load_kimi(tmp_path, dtype="float32", experts_int4=False)
  assert not dense_model.cfg.experts_int4
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg_dense.vocab_size, (2, 9)), jnp.int32)
  valid = jnp.ones((2, 9), bool).at[1, 7:].set(False)
  a = kimi.train_forward(packed_model, tokens, valid).logits
  b = kimi.train_forward(dense_model, tokens, valid).logits
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.isfinite(np.asarray(a)).all()


def test_non_finite_expert_weights_are_refused_when_quantising_on_load(tmp_path):
  loading.save_kimi(kimi.init_model(KimiConfig.tiny(), seed=9), tmp_path, dtype="bfloat16")
  (path,) = tmp_path.glob("*.safetensors")
  with safe_open(str(path), "np") as f:
    tensors = {name: f.get_tensor(name) for name in f.keys()}
  name = "model.layers.2.mlp.experts.5.up_proj.weight"
  tensors[name][3, 4] = np.inf
  save_file(tensors, str(path), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=f"{name} has non-finite values: it cannot be quantised to INT4"):
    loading.load_kimi(tmp_path, dtype="float32", experts_int4=True)


def test_int4_packed_tensors_outside_the_routed_experts_are_refused_by_name(tmp_path):
  """A scheme whose ignore list leaves an attention projection quantised: refused naming the
  tensor and the scheme, before any tensor is read (not as a tensor the config has no place for)."""
  write_k26_style_checkpoint(tmp_path, KimiConfig.tiny(), seed=5)
  path = tmp_path / "model.safetensors"
  with safe_open(str(path), "np") as f:
    tensors = {name: f.get_tensor(name) for name in f.keys()}
  name = "language_model.model.layers.1.self_attn.q_a_proj"
  packed, scale, _ = numpy_quantize_and_pack(tensors.pop(name + ".weight").astype(np.float32))
  tensors.update({name + ".weight_packed": packed, name + ".weight_scale": scale,
                  name + ".weight_shape": np.array([packed.shape[0], packed.shape[1] * 8], np.int64)})
  save_file(tensors, str(path), metadata={"format": "pt"})
  with pytest.raises(loading.CheckpointError, match=f"{name}.weight_packed is INT4-packed; only the routed "
                     "experts may be packed .* quantization_config's ignore list"):
    loading.load_kimi(tmp_path, dtype="float32")


def test_malformed_int4_expert_tensors_are_named(tmp_path):
  """An expert missing one of its three tensors fails before anything is read; a weight_packed of
  another integer width (which stacking a layer would silently promote) names the tensor."""
  write_k26_style_checkpoint(tmp_path, KimiConfig.tiny(), seed=5)
  path = tmp_path / "model.safetensors"
  with safe_open(str(path), "np") as f:
    tensors = {name: f.get_tensor(name) for name in f.keys()}
  name = "language_model.model.layers.2.mlp.experts.6.up_proj."
  save_file({k: v for k, v in tensors.items() if k != name + "weight_scale"}, str(path), metadata={"format": "pt"})
  with pytest.raises(loading.CheckpointError, match=f"1 tensors the model needs are not in the checkpoint "
                                                    f"\\({name}weight_scale\\)"):
    loading.load_kimi(tmp_path, dtype="float32")
  save_file({**tensors, name + "weight_packed": tensors[name + "weight_packed"].astype(np.int64)}, str(path),
            metadata={"format": "pt"})
  with pytest.raises(ValueError, match=f"tensor {name}weight_packed is int64, expected int32"):
    loading.load_kimi(tmp_path, dtype="float32")


def test_int4_model_saves_in_the_real_format_and_round_trips(tmp_path):
  model = kimi.init_model(CFG, seed=2)
  loading.save_kimi(model, tmp_path, dtype="bfloat16")
  config = json.loads((tmp_path / "config.json").read_text())
  int4.check_quantization_config(config["quantization_config"])
  ordered = json.loads(json.dumps(config["quantization_config"]))  # a copy with activation ordering
  next(iter(ordered["config_groups"].values()))["weights"]["actorder"] = "group"
  with pytest.raises(ValueError, match="actorder='group': only INT4 without activation ordering"):
    int4.check_quantization_config(ordered)
  reader = loading.ShardReader(tmp_path)
  names = set(reader.names())
  assert names == set(hf_io.hf_names(CFG))
  assert not any(".mlp.experts." in n and n.endswith(".weight") for n in names)
  name = "model.layers.1.mlp.experts.3.down_proj."
  dtypes = {}
  for file_name in set(reader.weight_map.values()):
    with safe_open(str(tmp_path / file_name), framework="numpy") as f:
      for key in f.keys():
        if key.startswith(name):
          dtypes[key[len(name):]] = f.get_tensor(key).dtype
  assert dtypes == {"weight_packed": np.int32, "weight_scale": ml_dtypes.bfloat16, "weight_shape": np.int64}
  assert reader(name + "weight_shape").tolist() == [CFG.hidden_size, CFG.moe_intermediate_size]
  assert reader(name + "weight_packed").shape == (CFG.hidden_size, CFG.moe_intermediate_size // 8)
  back = loading.load_kimi(tmp_path, dtype="float32")
  assert back.cfg.experts_int4
  mlp, mlp_back = model.moe_layers.mlp, back.moe_layers.mlp
  for attr in ("experts_gate_words", "experts_up_words", "experts_down_words", "experts_gate_scale",
               "experts_down_scale"):
    np.testing.assert_array_equal(np.asarray(getattr(mlp, attr)[...]).astype(np.float32),
                                  np.asarray(getattr(mlp_back, attr)[...]).astype(np.float32), err_msg=attr)


def test_bf16_checkpoint_quantised_on_load_equals_the_same_weights_quantised_offline(tmp_path, monkeypatch):
  """``experts_int4=True`` on a bf16 checkpoint quantises its routed experts on load; the model equals
  (experts bit for bit, logits) the one loaded from the INT4 checkpoint this file's own packer
  writes from the same bf16 weights. Two experts a quantisation call, so slices are joined."""
  cfg_dense = KimiConfig.tiny()
  dense = kimi.init_model(cfg_dense, seed=9)
  bf16_dir, int4_dir = tmp_path / "bf16", tmp_path / "int4"
  bf16_dir.mkdir()
  int4_dir.mkdir()
  loading.save_kimi(dense, bf16_dir, dtype="bfloat16")
  tensors = {}
  reader = loading.ShardReader(bf16_dir)
  for name in reader.names():
    value = np.asarray(reader(name))
    if ".mlp.experts." in name:
      packed, scale, _ = numpy_quantize_and_pack(value.astype(np.float32))
      base = name[:-len("weight")]
      tensors.update({base + "weight_packed": packed, base + "weight_scale": scale,
                      base + "weight_shape": np.array(value.shape, np.int64)})
    else:
      tensors[name] = value
  save_file(tensors, str(int4_dir / "model.safetensors"), metadata={"format": "pt"})
  config = json.loads((bf16_dir / "config.json").read_text())
  config["quantization_config"] = copy.deepcopy(int4.COMPRESSED_TENSORS_CONFIG)
  (int4_dir / "config.json").write_text(json.dumps(config))

  monkeypatch.setattr(hf_io, "QUANTIZE_EXPERTS_PER_CALL", 2)
  quantised = loading.load_kimi(bf16_dir, dtype="float32", experts_int4=True)
  offline = loading.load_kimi(int4_dir, dtype="float32")
  assert quantised.cfg.experts_int4 and offline.cfg.experts_int4
  mlp, want = quantised.moe_layers.mlp, offline.moe_layers.mlp
  for attr in ("experts_gate_words", "experts_up_words", "experts_down_words", "experts_gate_scale",
               "experts_up_scale", "experts_down_scale"):
    np.testing.assert_array_equal(np.asarray(getattr(mlp, attr)[...]).astype(np.float32),
                                  np.asarray(getattr(want, attr)[...]).astype(np.float32), err_msg=attr)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg_dense.vocab_size, (2, 7)), jnp.int32)
  valid = jnp.ones((2, 7), bool)
  got = np.asarray(kimi.train_forward(quantised, tokens, valid).logits)
  np.testing.assert_array_equal(got, np.asarray(kimi.train_forward(offline, tokens, valid).logits))
  # Quantised, not copied: the logits move off the bf16 model's (the experts' weights changed).
  assert not np.array_equal(got, np.asarray(kimi.train_forward(
      loading.load_kimi(bf16_dir, dtype="float32"), tokens, valid).logits))


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "fp8"}, "compressed-tensors"),
    ({"format": "naive-quantized"}, "pack-quantized"),
    ({"weights": {"num_bits": 8}}, "num_bits=8"),
    ({"weights": {"group_size": 128}}, "group_size=128"),
    ({"weights": {"symmetric": False}}, "symmetric=False"),
    ({"input_activations": {"num_bits": 8}}, "input_activations"),
])
def test_unsupported_quantization_configs_name_the_problem(change, message):
  qc = copy.deepcopy(int4.COMPRESSED_TENSORS_CONFIG)
  group = qc["config_groups"]["group_0"]
  for key, value in change.items():
    if key == "weights":
      group["weights"].update(value)
    elif key == "input_activations":
      group[key] = value
    else:
      qc[key] = value
  config = dict(KimiConfig.tiny().to_hf(), quantization_config=qc)
  with pytest.raises(ConfigError, match=message):
    KimiConfig.from_hf(config)


def test_int4_needs_feature_sizes_in_groups_of_32():
  with pytest.raises(ConfigError, match="multiples of 32"):
    KimiConfig.tiny(experts_int4=True, moe_intermediate_size=48)


def test_int4_target_speculative_decoding_is_lossless_and_accepted():
  """ddtree over an INT4 target (float32, XLA path) equals its greedy decoding; an exact oracle
  drafter is accepted whole (budget 8: 9 tokens a step until the end), so verification sees the
  same argmax as greedy decoding at every drafted position."""
  model = kimi.init_model(CFG, seed=0)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (5, 17)]
  max_new, max_len = 24, 96
  reference = greedy_reference(model, prompts, max_new, max_len)
  for drafter_kind in ("oracle", "noisy"):
    continuations = drafters.greedy_continuations(prompts, reference[0])
    drafter = drafters.OracleDrafter.make(continuations, vocab_size=CFG.vocab_size, max_len=max_len,
                                          noise=0.35 if drafter_kind == "noisy" else 0.0)
    dec = engine.SpeculativeDecoder(model, drafter, policy="ddtree", budgets=(8,), batch_buckets=(2,),
                                    max_len=max_len, show_progress=False)
    result = dec.generate(prompts, max_new, stop_token_ids=[])
    check_near_ties(result.tokens, *reference, dtype="float32", context=f"int4 target, {drafter_kind}")
    if drafter_kind == "oracle":  # every step takes the whole chain plus the bonus token
      assert len(result.steps) == -(-(max_new - 1) // 9), [step.accepted for step in result.steps]
