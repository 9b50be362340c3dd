"""What every training run shares: the optimizer, orbax checkpoints with resume, progress and logs."""

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation settings of one run.

  ``learning_rate`` peaks after ``warmup_steps`` of linear warm-up and decays by cosine to
  ``learning_rate * final_lr_ratio`` at ``steps``.
  """

  steps: int = 1000
  batch_size: int = 32
  seq_len: int = 256
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  final_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  seed: int = 0
  log_every: int = 20
  checkpoint_every: int = 500
  max_seconds: float | None = None  # stop (and checkpoint) early when the wall clock runs out

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len"):
      if getattr(self, name) <= 0:
        raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
    if not 0 <= self.warmup_steps <= self.steps:
      raise ValueError(f"TrainConfig.warmup_steps={self.warmup_steps} must lie in [0, steps={self.steps}]")
    for name in ("log_every", "checkpoint_every"):
      if getattr(self, name) <= 0:
        raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
    if self.learning_rate <= 0:
      raise ValueError(f"TrainConfig.learning_rate must be positive, got {self.learning_rate}")


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
  if tc.warmup_steps == 0:  # the peak from the first step (a warm-up of one step would waste it)
    return optax.cosine_decay_schedule(tc.learning_rate, decay_steps=tc.steps, alpha=tc.final_lr_ratio)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup_steps,
      decay_steps=max(tc.steps, tc.warmup_steps + 1), end_value=tc.learning_rate * tc.final_lr_ratio)


def decayed(params):
  """Which parameters weight decay applies to: matrices, not norm weights or biases (standard for
  transformers). By name, not rank: a stack of layers makes every norm weight 2-D."""
  def decays(path, p):
    name = jax.tree_util.keystr(path)
    return p.ndim >= 2 and "norm" not in name and "bias" not in name
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """AdamW with the schedule, clipping and decay mask of ``tc``. Runs whose optimisation settings
  are equal get the same object, so that their compiled steps (the optimizer is part of the step's
  static structure) are shared within a process."""
  return _optimizer(dataclasses.replace(tc, seed=0, log_every=1, checkpoint_every=1, max_seconds=None))


@functools.cache
def _optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                     optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                                 mask=decayed))


class Checkpointer:
  """Orbax checkpoints of (model, optimizer, step) with resume from the newest one."""

  def __init__(self, directory, max_to_keep: int = 2):
    self.directory = Path(directory).absolute()
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True))

  @staticmethod
  def _state(model, optimizer):
    return {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}

  def save(self, step: int, model, optimizer) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(self._state(model, optimizer)), force=True)
    self.manager.wait_until_finished()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore(self, model, optimizer, step: int | None = None) -> int:
    """Restores into ``model`` and ``optimizer`` in place; returns the restored step."""
    step = self.manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._state(model, optimizer))
    restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
    for obj, key in ((model, "model"), (optimizer, "optimizer")):
      state = nnx.state(obj)
      nnx.replace_by_pure_dict(state, restored[key])
      nnx.update(obj, state)
    return step

  def close(self):
    self.manager.close()


class RunLog:
  """One JSON line per logged step in ``<dir>/<name>_log.jsonl``, plus a summary at the end."""

  def __init__(self, directory, name: str):
    self.path = Path(directory) / f"{name}_log.jsonl"
    self.path.parent.mkdir(parents=True, exist_ok=True)

  def write(self, record: dict) -> None:
    with self.path.open("a") as f:
      f.write(json.dumps({k: (float(v) if isinstance(v, (np.floating, np.integer)) else v)
                          for k, v in record.items()}) + "\n")


def commit_state(*objs) -> None:
  """Commits every array of the NNX objects to the device it is on, in place.

  Orbax restores arrays committed to a device, freshly initialised ones are not, and jit compiles
  committed and uncommitted arguments as different programs: with both committed a resumed run
  reuses the executable a fresh run compiled (from the persistent cache) instead of compiling
  its step again.
  """
  for obj in objs:
    state = nnx.state(obj)
    nnx.update(obj, jax.tree.map(lambda x: x if getattr(x, "committed", True) else jax.device_put(x, x.sharding),
                                 state))


class RunMismatch(ValueError):
  """A resumed run whose settings differ from those its checkpoints were made with."""


# TrainConfig fields a resumed run may change: they do not change what it computes.
RESUMABLE_CHANGES = ("log_every", "checkpoint_every", "max_seconds")


def _check_finite(name: str, metrics, step: int, checkpointer: "Checkpointer") -> None:
  """Stops a run whose loss is not finite before it checkpoints (or exports) NaN weights."""
  loss = float(np.asarray(jax.device_get(metrics["loss"])))
  if not np.isfinite(loss):
    raise FloatingPointError(
        f"{name}: the loss is {loss} at step {step}; stopped without saving (the newest checkpoint: step "
        f"{checkpointer.latest_step()}). Check the corpus against the model (token ids past its vocabulary, "
        "another tokenizer) and the learning rate.")


def _check_resumable(checkpointer: "Checkpointer", record: dict, resume: bool) -> None:
  """Refuses to resume checkpoints made with other settings (``record``); records them for a new run
  (also one that does not resume, ``resume=False``, over older checkpoints)."""
  path = checkpointer.directory / "run.json"
  if resume and path.exists() and checkpointer.latest_step() is not None:
    saved = json.loads(path.read_text())
    changed = sorted(f"{group}.{key}: {saved.get(group, {}).get(key)!r} -> {value!r}"
                     for group, values in record.items() for key, value in values.items()
                     if saved.get(group, {}).get(key) != value)
    if changed:
      raise RunMismatch(f"{checkpointer.directory} holds a run with other settings ({'; '.join(changed)}); "
                        "resume it with its own settings or start the new run in another --out")
  else:
    path.write_text(json.dumps(record, indent=1, sort_keys=True))


def run_identity(model_cfg, dataset, **more) -> dict:
  """What a run's result depends on beside its TrainConfig: the model's configuration and the
  corpus (its tokenizer's hash, vocabulary and training tokens), plus ``more``."""
  manifest = getattr(getattr(dataset, "stream", None), "manifest", None) or {}
  corpus = {"tokenizer_sha256": manifest.get("tokenizer_sha256"), "vocab_size": manifest.get("vocab_size"),
            "train_tokens": manifest.get("splits", {}).get("train", {}).get("num_tokens")}
  return {"model": dataclasses.asdict(model_cfg), "corpus": corpus, **more}


def run_loop(*, name: str, tc: TrainConfig, model, optimizer, train_step: Callable, batch_at: Callable[[int], dict],
             out_dir, tokens_per_step: int, resume: bool = True, after_step: Callable | None = None,
             stop_at: int | None = None, show_progress: bool = True, identity: dict | None = None) -> dict:
  """The shared loop: resume, step, log, checkpoint, stop on step count or wall clock.

  Args:
    train_step: ``(model, optimizer, batch) -> metrics`` (jitted by the caller; mutates in place).
    batch_at: ``step -> batch``; deterministic in the step, so a resumed run sees the same data.
    after_step: optional ``(model, metrics) -> None`` hook (for example expert-bias balancing).
    stop_at: stop (and checkpoint) after this step, as an interrupted run would; the schedule
      still follows ``tc.steps``, so a resumed run continues exactly.
    identity: what else the run's result depends on ({"model": {...}, "corpus": {...}}, JSON
      values), kept with its checkpoints beside ``tc``: resuming with any of it changed is refused
      (``RunMismatch``), as is resuming with other optimisation settings.
  Returns:
    a summary dict (steps, final loss, wall time, tokens/s).
  Raises:
    FloatingPointError where the loss stops being finite (before any checkpoint of that state).
  """
  out_dir = Path(out_dir)
  checkpointer = Checkpointer(out_dir / f"{name}_checkpoints")
  log = RunLog(out_dir, name)
  record = {"train": {k: v for k, v in dataclasses.asdict(tc).items() if k not in RESUMABLE_CHANGES},
            **(identity or {})}
  _check_resumable(checkpointer, json.loads(json.dumps(record)), resume)
  start = 0
  if resume and checkpointer.latest_step() is not None:
    start = checkpointer.restore(model, optimizer)
    log.write({"event": "resumed", "step": start})
  commit_state(model, optimizer)
  t0 = time.perf_counter()
  last_log_t, last_log_step = t0, start
  metrics_host: dict = {}
  losses = []
  end = tc.steps if stop_at is None else min(stop_at, tc.steps)
  bar = tqdm(range(start, end), desc=name, initial=start, total=tc.steps, disable=not show_progress)
  done, metrics = start, None
  for step in bar:
    metrics = train_step(model, optimizer, batch_at(step))
    if after_step is not None:
      after_step(model, metrics)
    done = step + 1
    if done % tc.log_every == 0 or done == end:
      _check_finite(name, metrics, done, checkpointer)
      metrics_host = {k: np.asarray(v).tolist() for k, v in jax.device_get(metrics).items()}
      now = time.perf_counter()
      tok_s = tokens_per_step * (done - last_log_step) / max(now - last_log_t, 1e-9)
      last_log_t, last_log_step = now, done
      losses.append(metrics_host["loss"])
      bar.set_postfix(loss=f"{metrics_host['loss']:.4f}", tok_s=f"{tok_s:,.0f}")
      log.write({"step": done, "tokens_per_s": tok_s, "wall_s": now - t0,
                 **{k: v for k, v in metrics_host.items() if np.ndim(v) == 0}})
    if done % tc.checkpoint_every == 0:
      _check_finite(name, metrics, done, checkpointer)
      checkpointer.save(done, model, optimizer)
    if tc.max_seconds is not None and time.perf_counter() - t0 > tc.max_seconds:
      log.write({"event": "time limit", "step": done})
      break
  jax.block_until_ready(nnx.state(model))
  wall = time.perf_counter() - t0
  if checkpointer.latest_step() != done:
    if metrics is not None:
      _check_finite(name, metrics, done, checkpointer)
    checkpointer.save(done, model, optimizer)
  checkpointer.close()
  summary = {"name": name, "steps": done, "wall_s": wall, "final_loss": losses[-1] if losses else None,
             "tokens_per_s": tokens_per_step * (done - start) / max(wall, 1e-9)}
  log.write({"event": "done", **summary})
  return summary
