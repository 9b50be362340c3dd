"""Next-token pre-training of the Kimi-architecture target, with auxiliary-loss-free balancing.

bf16 compute over float32 master weights (``KimiConfig(dtype="bfloat16", param_dtype="float32")``).
Expert balancing is DeepSeek-V3's: after every step each MoE layer's ``e_score_correction_bias``
moves by ``bias_update_rate`` towards under-loaded experts (sign of mean load minus load). The bias
only steers selection; the gate weights stay unbiased, and no auxiliary loss touches the gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.train import loop
from models import kimi


def next_token_loss(model: kimi.KimiModel, tokens, valid=None):
  """Mean next-token cross-entropy over real positions.

  Args:
    tokens: int32[B, T + 1]; valid: optional bool[B, T + 1].
  Returns:
    (loss, (accuracy, expert_load int32[L_moe, E])).
  """
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  mask = jnp.ones(targets.shape, bool) if valid is None else valid[:, :-1] & valid[:, 1:]
  out = kimi.train_forward(model, inputs, valid=None if valid is None else valid[:, :-1])
  logp = jax.nn.log_softmax(out.logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  count = jnp.maximum(jnp.sum(mask), 1)
  loss = jnp.sum(jnp.where(mask, nll, 0.0)) / count
  accuracy = jnp.sum(jnp.where(mask, jnp.argmax(out.logits, -1) == targets, False)) / count
  return loss, (accuracy, out.expert_load)


def balance_experts(model: kimi.KimiModel, expert_load, rate: float) -> None:
  """DeepSeek-V3's bias update: raise under-loaded experts' bias, lower over-loaded ones'."""
  if model.moe_layers is None or rate == 0:
    return
  load = expert_load.astype(jnp.float32)  # [L_moe, E]
  bias = model.moe_layers.mlp.e_score_correction_bias
  bias[...] = bias[...] + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


@functools.cache
def make_train_step(bias_update_rate: float):
  @nnx.jit(donate_argnums=(0, 1))
  def train_step(model, optimizer, batch):
    grad_fn = nnx.value_and_grad(lambda m: next_token_loss(m, batch["tokens"]), has_aux=True)
    (loss, (accuracy, expert_load)), grads = grad_fn(model)
    optimizer.update(model, grads)
    balance_experts(model, expert_load, bias_update_rate)
    load = expert_load.astype(jnp.float32)
    imbalance = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1.0)
    return {"loss": loss, "accuracy": accuracy, "max_over_mean_load": jnp.mean(imbalance),
            "expert_load": expert_load}
  return train_step


def train_target(model: kimi.KimiModel, tc: loop.TrainConfig, dataset, out_dir, *, bias_update_rate: float = 1e-3,
                 resume: bool = True, stop_at: int | None = None, show_progress: bool = True) -> dict:
  """Trains ``model`` in place on ``dataset.batch(step)`` windows; returns the run summary.

  The summary's ``expert_load`` is the per-layer load histogram of the last logged step.
  """
  optimizer = nnx.Optimizer(model, loop.make_optimizer(tc), wrt=nnx.Param)
  train_step = make_train_step(bias_update_rate)
  last_load = {}

  def after_step(model, metrics):
    last_load["value"] = metrics["expert_load"]

  summary = loop.run_loop(
      name="target", tc=tc, model=model, optimizer=optimizer, train_step=train_step,
      batch_at=lambda step: {"tokens": dataset.batch(step)}, out_dir=out_dir,
      tokens_per_step=tc.batch_size * tc.seq_len, resume=resume, after_step=after_step, stop_at=stop_at,
      show_progress=show_progress, identity=loop.run_identity(model.cfg, dataset))
  if "value" in last_load:
    summary["expert_load"] = np.asarray(jax.device_get(last_load["value"])).tolist()
  return summary
