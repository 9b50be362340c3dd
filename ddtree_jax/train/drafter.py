"""DFlash drafter training against a frozen target (DESIGN §1.1).

Each step: the frozen target's features of a batch of windows (one causal forward, no gradient),
random anchors per sequence, and one drafter forward in which every anchor's block sees only the
context strictly before its anchor and not the other blocks; position-weighted cross-entropy.
"""

import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.train import loop
from models import dflash, kimi


@functools.cache
def make_train_step(feature_layers: tuple[int, ...], num_anchors: int, seed: int):
  @nnx.jit(donate_argnums=(1, 2))
  def train_step(target, drafter, optimizer, tokens, step):
    b, t = tokens.shape
    features = jax.lax.stop_gradient(kimi.train_forward(target, tokens, feature_layers=feature_layers).features)
    shared = dflash.DFlashDrafter.params(drafter, target)  # the target's own embedding and head
    embed, head = jax.lax.stop_gradient((shared.embed_table, shared.lm_head_kernel))
    valid_len = jnp.full((b,), t, jnp.int32)
    anchors = dflash.sample_anchors(jax.random.fold_in(jax.random.key(seed), step), valid_len, num_anchors, t)
    loss_fn = lambda d: dflash.train_loss(d, embed, head, tokens, features, anchors, valid_len)
    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(drafter)
    optimizer.update(drafter, grads)
    return {"loss": loss, "accepted_length": metrics["accepted_length"], "accuracy": metrics["accuracy"]}
  return train_step


def train_drafter(drafter: dflash.DFlashModel, target: kimi.KimiModel, tc: loop.TrainConfig, dataset, out_dir, *,
                  num_anchors: int = 16, resume: bool = True, stop_at: int | None = None,
                  show_progress: bool = True) -> dict:
  """Trains ``drafter`` in place with ``target`` frozen; returns the run summary.

  ``accepted_length`` in the log is the mean leading run of correct greedy block predictions:
  a training-time estimate of the chain acceptance (without the bonus token).
  """
  dflash_cfg = drafter.cfg
  optimizer = nnx.Optimizer(drafter, loop.make_optimizer(tc), wrt=nnx.Param)
  step_fn = make_train_step(tuple(dflash_cfg.target_layer_ids), num_anchors, tc.seed)
  train_step = lambda model, opt, batch: step_fn(target, model, opt, batch["tokens"], batch["step"])
  # Windows of seq_len tokens (the dataset's extra next-token column is not needed here).
  batch_at = lambda step: {"tokens": dataset.batch(step)[:, :tc.seq_len], "step": step}
  # The frozen target is an argument of the step too: nnx.jit hands it back committed, so an
  # uncommitted one (freshly loaded) would make the second step compile the step again.
  loop.commit_state(target)
  identity = loop.run_identity(dflash_cfg, dataset, target={"config": dataclasses.asdict(target.cfg),
                                                             "fingerprint": target_fingerprint(target)},
                              anchors={"num_anchors": num_anchors})
  return loop.run_loop(name="drafter", tc=tc, model=drafter, optimizer=optimizer, train_step=train_step,
                       batch_at=batch_at, out_dir=out_dir, tokens_per_step=tc.batch_size * tc.seq_len,
                       resume=resume, stop_at=stop_at, show_progress=show_progress, identity=identity)


def target_fingerprint(target: kimi.KimiModel) -> str:
  """A hash of a few of the target's weights (the final norm, the first rows of the embedding):
  enough to tell a drafter's resumed run that its frozen target is another model."""
  sample = (target.norm.weight[...], target.embed_tokens.embedding[...][:64])
  return hashlib.sha256(b"".join(np.asarray(jax.device_get(x), np.float32).tobytes() for x in sample)).hexdigest()
