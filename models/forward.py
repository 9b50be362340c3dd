"""Entry points of the target model: chunked prefill, tree verify, KV commit.

All are pure functions of (model, cache, inputs) that run with or without ``jax.jit``. Shapes
are checked when traced (so a bad call fails before any compute); slots are checked when they
are concrete, and against a ``SlotPool`` (host mirror of committed lengths) when one is given.
"""

import contextlib
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import cache as cache_lib
from models.kimi import KimiModel, Window


def matmul_precision(cfg):
  """The context every compiled forward of a model runs under: full float32 products for a
  float32 model (the GPU's default for float32 is TF32, whose rounding would undo the exactness
  that float32 equality tests and lossless serving rely on); the backend's default otherwise."""
  return jax.default_matmul_precision("highest") if cfg.dtype == "float32" else contextlib.nullcontext()


def _check_window_args(model: KimiModel, tokens, positions, visibility, valid, slots, cache,
                       feature_layers):
  """Raises ValueError naming the first malformed argument (shapes and dtypes only)."""
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [batch, q_len], got shape {tokens.shape}")
  b, q = tokens.shape
  expected = {"positions": (positions, (b, q)), "visibility": (visibility, (b, q, q)),
              "valid": (valid, (b, q)), "slots": (slots, (b,))}
  for name, (value, shape) in expected.items():
    if tuple(value.shape) != shape:
      raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape} for tokens {tokens.shape}")
  for name, value in (("tokens", tokens), ("positions", positions), ("slots", slots)):
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(f"{name} must be integers, got {value.dtype}")
  for name, value in (("visibility", visibility), ("valid", valid)):
    if value.dtype != jnp.bool_:
      raise ValueError(f"{name} must be bool, got {value.dtype}")
  if q > cache.max_len:
    raise ValueError(f"window of {q} rows exceeds the cache's max_len {cache.max_len}")
  layers = model.cfg.num_hidden_layers
  if len(set(feature_layers)) != len(feature_layers):
    raise ValueError(f"feature layers {list(feature_layers)} repeat an id")
  for layer_id in feature_layers:
    if not 0 <= layer_id < layers:
      raise ValueError(f"feature layer {layer_id} outside [0, {layers}) (0-based decoder layer ids)")
  if not isinstance(slots, jax.core.Tracer):
    bad = [int(s) for s in np.asarray(slots).reshape(-1) if not 0 <= int(s) <= cache.scratch_slot]
    if bad:
      raise ValueError(f"unknown slot {bad[0]}: the cache has slots 0..{cache.num_slots - 1} "
                       f"(and scratch slot {cache.scratch_slot})")


def verify(model: KimiModel, tree_tokens, positions, visibility, valid, slots, cache,
           *, feature_layers: Sequence[int] = (), pool: cache_lib.SlotPool | None = None):
  """Forward over a flattened tree window after each request's committed prefix.

  Args:
    tree_tokens: int32[B, Q]; positions: int32[B, Q] (``start + depth``; valid even if padded);
    visibility: bool[B, Q, Q] (ancestor-or-self); valid: bool[B, Q];
    slots: int32[B] cache slots; cache: the pool.
    feature_layers: static decoder-layer ids whose outputs to return.
    pool: optional host mirror; when given, the window is checked to fit before dispatch.
  Returns:
    (logits float32[B, Q, V], features [B, Q, K, H], cache, expert_load int32[L_moe, E]).
    The window's KV is written at ``[len, len + Q)`` of each slot; committed rows are untouched
    and the lengths do not change until ``commit``.
  """
  feature_layers = tuple(feature_layers)
  _check_window_args(model, tree_tokens, positions, visibility, valid, slots, cache, feature_layers)
  if pool is not None:
    pool.check_window(np.asarray(slots), tree_tokens.shape[1])
  window = Window(positions=positions.astype(jnp.int32), visibility=visibility, valid=valid,
                  slots=slots.astype(jnp.int32), prefix_len=cache.lengths[slots])
  out, cache = model(tree_tokens.astype(jnp.int32), window, cache, feature_layers=feature_layers)
  return out.logits, out.features, cache, out.expert_load


def commit(cache: cache_lib.KVCache, slots, accepted_nodes, num_accepted):
  """Gathers accepted window rows to the end of each prefix and advances the lengths.

  Args:
    slots: int32[B]; accepted_nodes: int32[B, Q] window rows in path order (node 0 first);
    num_accepted: int32[B] rows to commit (0 leaves a slot untouched).
  """
  if accepted_nodes.ndim != 2 or accepted_nodes.shape[0] != slots.shape[0]:
    raise ValueError(f"accepted_nodes has shape {accepted_nodes.shape}, expected [{slots.shape[0]}, q_len]")
  if num_accepted.shape != slots.shape:
    raise ValueError(f"num_accepted has shape {num_accepted.shape}, expected {slots.shape}")
  return cache_lib.commit(cache, slots.astype(jnp.int32), accepted_nodes.astype(jnp.int32),
                          num_accepted.astype(jnp.int32))


def prefill_chunk(model: KimiModel, tokens, num_valid, slots, cache, *,
                  feature_layers: Sequence[int] = (), all_logits: bool = False):
  """One causal chunk of prompt after each request's committed prefix, committed at once.

  Args:
    tokens: int32[B, C]; num_valid: int32[B] real tokens in this chunk (0..C); slots: int32[B].
  Returns:
    (ForwardOutput, cache). Logits are for every row when ``all_logits``, else for the last real
    row of each request ([B, 1, V]; meaningless where num_valid is 0).
  """
  b, c = tokens.shape
  offsets = jnp.arange(c, dtype=jnp.int32)
  prefix_len = cache.lengths[slots]
  positions = prefix_len[:, None] + offsets[None, :]
  valid = offsets[None, :] < num_valid[:, None]
  visibility = jnp.broadcast_to(jnp.tril(jnp.ones((c, c), bool)), (b, c, c))
  _check_window_args(model, tokens, positions, visibility, valid, slots, cache, tuple(feature_layers))
  window = Window(positions=positions, visibility=visibility, valid=valid,
                  slots=slots.astype(jnp.int32), prefix_len=prefix_len)
  rows = None if all_logits else jnp.maximum(num_valid - 1, 0)[:, None].astype(jnp.int32)
  out, cache = model(tokens.astype(jnp.int32), window, cache, feature_layers=tuple(feature_layers),
                     logits_rows=rows)
  return out, cache_lib.advance(cache, slots, num_valid.astype(jnp.int32))


@functools.cache
def _jitted_prefill_chunk(feature_layers, all_logits):
  return jax.jit(functools.partial(prefill_chunk, feature_layers=feature_layers, all_logits=all_logits),
                 donate_argnames=("cache",))


def prefill(model: KimiModel, prompts: Sequence[Sequence[int]], slots, cache, *, chunk_size: int = 64,
            feature_layers: Sequence[int] = (), all_logits: bool = False,
            pool: cache_lib.SlotPool | None = None, jit: bool = True):
  """Runs prompts through the model in fixed-size causal chunks and commits them.

  Compiles once per (batch, chunk_size); memory is bounded by the chunk whatever the length.

  Args:
    prompts: B token sequences (lengths may differ; each at least one token).
    slots: B cache slots, each holding the request's already committed prefix (usually empty).
  Returns:
    (last_logits float32[B, V], all_logits float32[B, T, V] or None, features [B, T, K, H], cache)
    with T the longest prompt rounded up to whole chunks; rows past a prompt's end are padding.
  """
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}")
  lengths = np.array([len(p) for p in prompts], np.int64)
  if len(prompts) == 0 or (lengths == 0).any():
    raise ValueError("prefill needs at least one prompt and no empty prompt "
                     f"(lengths {lengths.tolist()})")
  slots = np.asarray(slots, np.int32)
  if slots.shape != (len(prompts),):
    raise ValueError(f"slots has shape {slots.shape}, expected ({len(prompts)},)")
  vocab = model.cfg.vocab_size
  for i, prompt in enumerate(prompts):
    arr = np.asarray(prompt)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"prompt {i} must be a flat sequence of int token ids")
    if arr.min() < 0 or arr.max() >= vocab:
      raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
  if pool is not None:
    starts = pool.check_window(slots, 0)
    over = starts + lengths > pool.max_len
    if over.any():
      i = int(np.argmax(over))
      raise cache_lib.CacheError(
          f"prompt {i} of {int(lengths[i])} tokens does not fit slot {int(slots[i])}: "
          f"{int(starts[i])} committed + {int(lengths[i])} > max_len {pool.max_len}")
  num_chunks = -(-int(lengths.max()) // chunk_size)
  padded = np.zeros((len(prompts), num_chunks * chunk_size), np.int32)
  for i, prompt in enumerate(prompts):
    padded[i, :lengths[i]] = np.asarray(prompt)
  step = (_jitted_prefill_chunk(tuple(feature_layers), all_logits) if jit else
          functools.partial(prefill_chunk, feature_layers=tuple(feature_layers), all_logits=all_logits))
  slots_dev = jnp.asarray(slots)
  last_logits, logits, features = None, [], []
  for chunk in range(num_chunks):
    num_valid = np.clip(lengths - chunk * chunk_size, 0, chunk_size).astype(np.int32)
    out, cache = step(model, jnp.asarray(padded[:, chunk * chunk_size:(chunk + 1) * chunk_size]),
                      jnp.asarray(num_valid), slots_dev, cache)
    if all_logits:
      logits.append(out.logits)
      chunk_last = jnp.take_along_axis(
          out.logits, jnp.maximum(jnp.asarray(num_valid) - 1, 0)[:, None, None], axis=1)[:, 0]
    else:
      chunk_last = out.logits[:, 0]
    ends_here = jnp.asarray(num_valid > 0)[:, None]
    last_logits = chunk_last if last_logits is None else jnp.where(ends_here, chunk_last, last_logits)
    features.append(out.features)
  if pool is not None:
    pool.record_commit(slots, lengths)
  return (last_logits, jnp.concatenate(logits, axis=1) if all_logits else None,
          jnp.concatenate(features, axis=1), cache)


def decode_step(model: KimiModel, tokens, slots, cache, *, feature_layers: Sequence[int] = ()):
  """Plain autoregressive step: ``verify`` with Q = 1, then commit the one row.

  Args:
    tokens: int32[B] the last emitted token of each request (at position ``len``).
  Returns:
    (logits float32[B, V], features [B, K, H], cache).
  """
  b = tokens.shape[0]
  positions = cache.lengths[slots][:, None]
  logits, features, cache, _ = verify(
      model, tokens[:, None], positions, jnp.ones((b, 1, 1), bool), jnp.ones((b, 1), bool), slots,
      cache, feature_layers=feature_layers)
  cache = cache_lib.advance(cache, slots, jnp.ones((b,), jnp.int32))
  return logits[:, 0], features[:, 0], cache
