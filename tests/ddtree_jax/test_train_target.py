"""Target pre-training: loss goes down, expert balancing moves the bias, checkpoints resume exactly,
and exported safetensors reload to identical logits. Tiny config, CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ddtree_jax.train import loop, target
from models import kimi, loading
from models.config import KimiConfig

CFG = KimiConfig.tiny(dtype="bfloat16", param_dtype="float32")
# One optimisation for the tests that train (the schedule is part of the compiled step: one compile).
TC = loop.TrainConfig(steps=12, batch_size=4, seq_len=24, learning_rate=1e-2, warmup_steps=2, log_every=4,
                      checkpoint_every=100)


class FixedBatch:
  def __init__(self, seed=0, batch=4, seq=24):
    self.tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (batch, seq + 1)).astype(np.int32)

  def batch(self, step):
    return self.tokens


def params_of(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def test_loss_decreases_and_bias_balances(tmp_path):
  model = kimi.init_model(CFG, seed=0)
  loop.commit_state(model)  # as training leaves it, so that both losses run one compiled loss
  loss_of = nnx.jit(target.next_token_loss)
  data = FixedBatch()
  before, _ = loss_of(model, jnp.asarray(data.tokens))
  bias_before = np.asarray(model.moe_layers.mlp.e_score_correction_bias[...]).copy()
  summary = target.train_target(model, TC, data, tmp_path, show_progress=False)
  after, (_, load) = loss_of(model, jnp.asarray(data.tokens))
  assert float(after) < 0.7 * float(before)
  assert summary["steps"] == 12 and (tmp_path / "target_log.jsonl").exists()
  # The bias moved by exactly +-rate per step: every entry changed, in steps of 1e-3.
  moved = np.asarray(model.moe_layers.mlp.e_score_correction_bias[...]) - bias_before
  assert np.all(np.abs(moved) > 0) and np.all(np.abs(moved) <= 12 * 1e-3 + 1e-6)
  assert np.asarray(load).sum(-1).tolist() == [4 * 24 * CFG.num_experts_per_tok] * CFG.num_moe_layers


def test_balance_experts_follows_the_sign_of_the_load_gap():
  model = kimi.init_model(CFG, seed=1)
  bias = np.asarray(model.moe_layers.mlp.e_score_correction_bias[...]).copy()
  load = np.tile(np.arange(CFG.n_routed_experts), (CFG.num_moe_layers, 1))  # mean 3.5
  target.balance_experts(model, jnp.asarray(load), 0.01)
  moved = np.asarray(model.moe_layers.mlp.e_score_correction_bias[...]) - bias
  np.testing.assert_allclose(moved, 0.01 * np.sign(3.5 - load), atol=1e-7)


def test_checkpoint_restore_gives_identical_params_and_next_step(tmp_path):
  data = FixedBatch(seed=3)
  tc = dataclasses.replace(TC, log_every=2, checkpoint_every=3)  # the compiled step of TC
  # Run A: 12 steps straight. Run B: 3 steps, then a fresh process-like restart resuming to 12.
  model_a = kimi.init_model(CFG, seed=0)
  target.train_target(model_a, tc, data, tmp_path / "a", show_progress=False)
  model_b = kimi.init_model(CFG, seed=0)
  target.train_target(model_b, tc, data, tmp_path / "b", stop_at=3, show_progress=False)
  saved = params_of(model_b)
  model_c = kimi.init_model(CFG, seed=5)  # different init: everything must come from the checkpoint
  optimizer = nnx.Optimizer(model_c, loop.make_optimizer(tc), wrt=nnx.Param)
  assert loop.Checkpointer(tmp_path / "b" / "target_checkpoints").restore(model_c, optimizer) == 3
  jax.tree.map(np.testing.assert_array_equal, params_of(model_c), saved)
  # Resuming those checkpoints with other settings (here the learning rate) is refused by name.
  with pytest.raises(loop.RunMismatch, match="train.learning_rate: 0.01 -> 0.001"):
    target.train_target(kimi.init_model(CFG, seed=5), dataclasses.replace(tc, learning_rate=1e-3), data,
                        tmp_path / "b", show_progress=False)
  model_d = kimi.init_model(CFG, seed=5)
  target.train_target(model_d, tc, data, tmp_path / "b", show_progress=False)  # resumes at step 3
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=1e-6), params_of(model_d), params_of(model_a))


def test_exported_safetensors_reload_to_identical_logits(tmp_path):
  model = kimi.init_model(KimiConfig.tiny(), seed=2)
  loading.save_kimi(model, tmp_path, dtype="float32", max_shard_bytes=100_000)
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  reloaded = loading.load_kimi(tmp_path)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
  np.testing.assert_array_equal(np.asarray(kimi.train_forward(model, tokens).logits),
                                np.asarray(kimi.train_forward(reloaded, tokens).logits))
  # bf16 export: the reload equals the bf16-rounded parameters exactly.
  loading.save_kimi(model, tmp_path / "bf16")
  half = loading.load_kimi(tmp_path / "bf16", dtype="float32", param_dtype="float32")
  rounded = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)),
                         params_of(model)["embed_tokens"])
  jax.tree.map(np.testing.assert_array_equal, params_of(half)["embed_tokens"], rounded)


def test_weight_decay_spares_every_norm_weight_and_warmup_zero_starts_at_the_peak():
  """Three AdamW steps of zero gradients move only decayed weights: every matrix, no norm weight
  (stacked layers make those 2-D, so rank alone would decay them)."""
  # The model's parameter names and shapes (stacked layers), all ones.
  abstract = nnx.to_pure_dict(nnx.state(kimi.abstract_model(CFG), nnx.Param))
  params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), abstract)
  tc = loop.TrainConfig(steps=10, warmup_steps=0, learning_rate=1e-2, weight_decay=0.5)
  tx = loop.make_optimizer(tc)

  @jax.jit
  def three_steps(params):
    state = tx.init(params)
    for _ in range(3):
      updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
      params = optax.apply_updates(params, updates)
    return params
  before = jax.tree_util.tree_flatten_with_path(params)[0]
  after = dict(jax.tree_util.tree_flatten_with_path(three_steps(params))[0])
  moved = {jax.tree_util.keystr(path): not np.array_equal(value, after[path]) for path, value in before}
  norms = {name: m for name, m in moved.items() if "norm" in name}
  assert len(norms) >= 5 and not any(norms.values()), norms  # per-layer and final norms
  assert all(m for name, m in moved.items() if "kernel" in name or "experts_" in name), moved
  schedule = loop.learning_rate_schedule(tc)
  assert float(schedule(0)) == pytest.approx(1e-2) and float(schedule(10)) == pytest.approx(1e-3)
  warm = loop.learning_rate_schedule(dataclasses.replace(tc, warmup_steps=2))
  assert [float(warm(i)) for i in (0, 1, 2)] == pytest.approx([0.0, 5e-3, 1e-2])


def test_a_run_whose_loss_stops_being_finite_stops_before_it_checkpoints(tmp_path):
  model = kimi.init_model(CFG, seed=0)
  tc = loop.TrainConfig(steps=8, batch_size=4, seq_len=24, warmup_steps=1, log_every=100, checkpoint_every=2)
  optimizer = nnx.Optimizer(model, loop.make_optimizer(tc), wrt=nnx.Param)
  step_fn = lambda model, optimizer, batch: {"loss": jnp.float32(np.nan if batch["step"] >= 3 else 1.0)}
  with pytest.raises(FloatingPointError, match="the loss is nan at step 4; stopped without saving "
                                               "\\(the newest checkpoint: step 2\\)"):
    loop.run_loop(name="toy", tc=tc, model=model, optimizer=optimizer, train_step=step_fn,
                  batch_at=lambda step: {"step": step}, out_dir=tmp_path, tokens_per_step=1, show_progress=False)
  assert loop.Checkpointer(tmp_path / "toy_checkpoints").latest_step() == 2
