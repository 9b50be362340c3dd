"""The speculative decoding engine: one compiled step per (batch bucket, budget).

A step is one function, read top to bottom in ``speculative_step``:

    draft (drafter.propose) -> tree (policy) -> verify (one target forward over the tree)
    -> accept (walk the target's draws down the tree) -> commit (target KV and drafter context)

Budget 0 is plain autoregressive decoding through the same function (a root-only tree); the
drafter's context still advances, so budgets may change between steps without losing acceptance.

Every (batch bucket, budget) pair is compiled ahead of time (``jit(...).lower(...).compile()``);
``generate`` then never compiles. The host dispatches step k + 1 before it reads step k's tokens:
finishing (stop tokens, token limits) is tracked on the device, so the host never waits inside a
step, and a request that finishes mid-batch simply stops being active.
"""

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ddtree_jax import logprobs as logprobs_lib
from ddtree_jax import policies
from ddtree_jax import tree as tree_lib
from ddtree_jax import verify as verify_lib
from models import cache as cache_lib
from models import forward as fwd
from models.kimi import KimiModel


class EngineError(ValueError):
  """A request or engine setting that cannot be served; the message names the argument."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Per-row state carried from step to step on the device (all ``[B]``).

  Attributes:
    root: int32, the last emitted token (at position ``cache.lengths[slot]``, not yet committed).
    active: bool, the row holds an unfinished request.
    remaining: int32, tokens the request may still emit.
  """

  root: jax.Array
  active: jax.Array
  remaining: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What one step hands back to the host (all ``[B]`` unless noted).

  Attributes:
    emitted: int32[B, Q] tokens emitted this step (accepted drafts then the bonus).
    num_emitted: int32, entries of ``emitted`` to read (0 for inactive rows).
    num_accepted: int32, committed tree nodes (accepted draft tokens + 1; 0 when inactive).
    tree_size: int32, real nodes in the verified tree (root included).
    finished: bool, the request ended this step (stop token or token limit).
    sibling_accepts: int32, accepted draft tokens that were not their position's rank-0 candidate
      (what a tree recovers and a chain cannot).
    experts_touched: int32 scalar, distinct (layer, expert) pairs the verify forward used.
    logprobs: the emitted tokens' log-probabilities ``[B, Q]`` and their alternatives, or None
      when the engine computes none (``SpeculativeDecoder(logprobs=...)``).
  """

  emitted: jax.Array
  num_emitted: jax.Array
  num_accepted: jax.Array
  tree_size: jax.Array
  finished: jax.Array
  sibling_accepts: jax.Array
  experts_touched: jax.Array
  logprobs: logprobs_lib.TokenLogprobs | None = None


# The columns of a packed StepOutput after the Q of ``emitted``, in order.
_PACKED_FIELDS = ("num_emitted", "num_accepted", "tree_size", "finished", "sibling_accepts", "experts_touched")


def pack_output(out: StepOutput) -> jax.Array:
  """int32[B, W]: ``emitted`` (Q columns), then the log-probabilities if any (``_pack_logprobs``:
  Q (1 + 2n) columns), then one column per other field (``experts_touched`` on every row).

  The host reads a step's output with one device-to-host copy instead of seven: on the GPU a copy
  asked for when the host reads took hundreds of microseconds to come back, even of an array long
  computed (``docs/engine_step.md``).
  """
  rows = out.emitted.shape[0]
  columns = [jnp.broadcast_to(getattr(out, name), (rows,)).astype(jnp.int32)[:, None] for name in _PACKED_FIELDS]
  lp = [] if out.logprobs is None else _pack_logprobs(out.logprobs)
  return jnp.concatenate([out.emitted.astype(jnp.int32), *lp, *columns], axis=1)


def unpack_output(packed: np.ndarray, top_n: int | None = None) -> StepOutput:
  """The StepOutput (numpy) that ``pack_output`` packed; ``top_n``: the engine's ``logprobs``
  (None: the step computed none)."""
  width = packed.shape[1] - len(_PACKED_FIELDS)
  if top_n is not None and width % (2 + 2 * top_n):
    raise ValueError(f"a packed step output of {packed.shape[1]} columns holds no logprobs with top_n={top_n}")
  q_len = width if top_n is None else width // (2 + 2 * top_n)
  fields = {name: packed[:, width + i] for i, name in enumerate(_PACKED_FIELDS)}
  fields["finished"] = fields["finished"].astype(bool)
  fields["experts_touched"] = fields["experts_touched"][0]
  lp = None if top_n is None else _unpack_logprobs(packed[:, q_len:width], q_len, top_n)
  return StepOutput(emitted=packed[:, :q_len], logprobs=lp, **fields)


def _pack_logprobs(lp: logprobs_lib.TokenLogprobs) -> list:
  """int32 columns: the tokens' float32 log-probabilities bit for bit, the alternatives' ids, their
  log-probabilities (Q, Q n and Q n columns)."""
  rows = lp.token.shape[0]
  as_bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32).reshape(rows, -1)
  return [as_bits(lp.token), lp.top_ids.reshape(rows, -1).astype(jnp.int32), as_bits(lp.top)]


def _unpack_logprobs(columns: np.ndarray, q_len: int, top_n: int) -> logprobs_lib.TokenLogprobs:
  rows = columns.shape[0]
  columns = np.ascontiguousarray(columns)
  token = columns[:, :q_len].view(np.float32)
  top_ids = columns[:, q_len:q_len * (1 + top_n)].reshape(rows, q_len, top_n)
  top = columns[:, q_len * (1 + top_n):].view(np.float32).reshape(rows, q_len, top_n)
  return logprobs_lib.TokenLogprobs(token=token, top_ids=top_ids, top=top)


def packed_step(*args, **kwargs):
  """``speculative_step`` with its StepOutput packed for one host read (``pack_output``)."""
  target_cache, drafter_state, decode, out = speculative_step(*args, **kwargs)
  return target_cache, drafter_state, decode, pack_output(out)


def speculative_step(target: KimiModel, drafter_params, target_cache, drafter_state, decode: DecodeState,
                     slots, sampling: verify_lib.SamplingParams, stop_tokens, stop_valid, *,
                     drafter, policy: Callable, budget: int, top_k: int, logprobs: int | None = None):
  """One draft -> tree -> verify -> accept -> commit step for a batch of rows.

  Args:
    slots: int32[B] cache slots (the scratch slot for rows without a request).
    stop_tokens: int32[B, S] with stop_valid: bool[B, S].
    logprobs: None, or the alternatives per emitted token whose log-probabilities the step
      returns with the tokens' own (``ddtree_jax.logprobs``).
  Returns:
    (target_cache, drafter_state, decode, StepOutput).
  """
  start = target_cache.lengths[slots]
  active = decode.active
  if budget > 0:
    ids, draft_logprobs = drafter.propose(drafter_params, drafter_state, slots, decode.root, start, top_k)
    max_depth = jnp.where(active, jnp.clip(decode.remaining - 1, 0, drafter.num_positions), 0)
    try:
      drafted = policy(decode.root, start, ids, draft_logprobs, budget, max_depth)
    except EngineError:
      raise
    except Exception as err:  # pylint: disable=broad-except  # traced when the step compiles
      raise EngineError(f"policy {_policy_name(policy)!r} failed at budget {budget}: "
                        f"{type(err).__name__}: {err}") from err
    drafted = _check_policy_tree(drafted, policy, budget, decode.root.shape[0])
    # Only the policy's choice of nodes is kept: the rest is derived, so no policy can make the
    # target verify a node at the wrong place or with the wrong context.
    tree = tree_lib.canonical_tree(drafted, decode.root, start, max_depth, target.cfg.vocab_size)
    rank0 = jnp.take_along_axis(ids[:, :, 0], jnp.clip(tree.depth - 1, 0, ids.shape[1] - 1), axis=1)
    off_rank0 = (tree.depth > 0) & (tree.tokens != rank0)  # [B, Q]
  else:
    tree = policies.root_only_tree(decode.root, start)
    off_rank0 = jnp.zeros(tree.tokens.shape, bool)
  # Inactive rows verify padding only (their root stays real: a padded row sees only itself).
  tree = dataclasses.replace(tree, valid=tree.valid & active[:, None])

  logits, features, target_cache, expert_load = fwd.verify(
      target, tree.tokens, tree.positions, tree.visibility, tree.valid, slots, target_cache,
      feature_layers=drafter.feature_layers)
  result = verify_lib.verify(logits, tree, sampling, stop_tokens, stop_valid)

  num_commit = jnp.where(active, result.num_accepted, 0)
  on_path = jnp.arange(tree.q_len)[None, :] < num_commit[:, None]
  sibling_accepts = jnp.sum(on_path & jnp.take_along_axis(off_rank0, result.accepted_nodes, axis=1), axis=1)
  target_cache = fwd.commit(target_cache, slots, result.accepted_nodes, num_commit)
  path_tokens = jnp.take_along_axis(tree.tokens, result.accepted_nodes, axis=1)
  path_features = jnp.take_along_axis(features, result.accepted_nodes[:, :, None, None], axis=1)
  path_positions = start[:, None] + jnp.arange(tree.q_len, dtype=jnp.int32)[None, :]
  drafter_state = drafter.extend(drafter_params, drafter_state, slots, path_tokens, path_positions,
                                 path_features, num_commit)

  num_emitted = jnp.where(active, jnp.minimum(result.num_emitted, decode.remaining), 0)
  remaining = decode.remaining - num_emitted
  finished = active & (result.hit_stop | (remaining <= 0))
  decode = DecodeState(root=jnp.where(active, result.bonus, decode.root), active=active & ~finished,
                       remaining=remaining)
  out = StepOutput(emitted=result.emitted, num_emitted=num_emitted, num_accepted=num_commit,
                   tree_size=jnp.sum(tree.valid, axis=1).astype(jnp.int32), finished=finished,
                   sibling_accepts=sibling_accepts.astype(jnp.int32),
                   experts_touched=jnp.sum(expert_load > 0).astype(jnp.int32),
                   logprobs=None if logprobs is None else logprobs_lib.token_logprobs(
                       logits, result.accepted_nodes, result.emitted, logprobs))
  return target_cache, drafter_state, decode, out


def _policy_name(policy) -> str:
  return getattr(policy, "__name__", None) or getattr(getattr(policy, "func", None), "__name__", repr(policy))


def _check_policy_tree(drafted, policy, budget: int, batch: int):
  """Trace-time checks of what a policy returned (an ``EngineError`` naming the policy)."""
  name = _policy_name(policy)
  if not isinstance(drafted, tree_lib.Tree):
    raise EngineError(f"policy {name!r} returned {type(drafted).__name__}, not a tree.Tree "
                      "(build one with tree.tree_from_parents)")
  want = (batch, budget + 1)
  for field, kind in (("tokens", "integer"), ("parents", "integer"), ("valid", "bool")):
    value = getattr(drafted, field)
    shape, dtype = tuple(getattr(value, "shape", ())), getattr(value, "dtype", None)
    if shape != want:
      raise EngineError(f"policy {name!r} returned {field} of shape {shape} at budget {budget}; a tree has "
                        f"[batch, budget + 1] = {list(want)} rows (pad unused rows with valid=False)")
    # Narrower integers would wrap token ids silently (lossless still, but nothing accepted).
    ok = dtype == jnp.bool_ if kind == "bool" else (
        dtype is not None and jnp.issubdtype(dtype, jnp.integer) and jnp.dtype(dtype).itemsize >= 4)
    if not ok:
      raise EngineError(f"policy {name!r} returned {field} of dtype {dtype}; expected "
                        f"{'bool' if kind == 'bool' else 'int32 (or another integer of 32 bits or more)'}")
  return drafted


def prefill_step(target: KimiModel, drafter_params, target_cache, drafter_state, tokens, num_valid, slots, *,
                 drafter):
  """One prompt chunk into the target cache and the drafter context; returns last-row logits."""
  logits, target_cache, drafter_state = _prefill_chunk(target, drafter_params, target_cache, drafter_state, tokens,
                                                       num_valid, slots, drafter, all_logits=False)
  return target_cache, drafter_state, logits[:, 0]


def _prefill_chunk(target, drafter_params, target_cache, drafter_state, tokens, num_valid, slots, drafter, *,
                   all_logits: bool):
  """The target's prefill of one chunk and the drafter's extension with its features; returns
  (logits [B, C, V] with ``all_logits``, else the last real row's [B, 1, V], target_cache, drafter_state)."""
  out, target_cache = fwd.prefill_chunk(target, tokens, num_valid, slots, target_cache,
                                        feature_layers=drafter.feature_layers, all_logits=all_logits)
  start = target_cache.lengths[slots] - num_valid
  positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  drafter_state = drafter.extend(drafter_params, drafter_state, slots, tokens, positions, out.features, num_valid)
  return out.logits, target_cache, drafter_state


def prefill_logprobs_step(target: KimiModel, drafter_params, target_cache, drafter_state, tokens, num_valid, slots,
                          next_tokens, *, drafter, logprobs: int):
  """``prefill_step`` that also returns the chunk's prompt log-probabilities (``echo`` with logprobs).

  The last row's logits, from which the first token is drawn, come from the head over all rows,
  not over the one row ``prefill_step`` gathers: where a GPU's GEMMs round the two shapes
  differently in the last bits, the first token may differ from plain decoding at a near tie (the
  rule every equality test applies), never elsewhere. Only requests that ask take this path.

  Args:
    next_tokens: int32[B, C], the prompt token after each row's (what its logits predict).
  Returns:
    (target_cache, drafter_state, last-row logits, int32[B, C (1 + 2 logprobs)]: each row's
    log-probability of its next token and the row's top ``logprobs``, packed as ``pack_output``
    packs them).
  """
  logits, target_cache, drafter_state = _prefill_chunk(target, drafter_params, target_cache, drafter_state, tokens,
                                                       num_valid, slots, drafter, all_logits=True)
  last = jnp.take_along_axis(logits, jnp.maximum(num_valid - 1, 0)[:, None, None], axis=1)[:, 0]
  rows = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  lp = logprobs_lib.token_logprobs(logits, rows, next_tokens.astype(jnp.int32), logprobs)
  return target_cache, drafter_state, last, jnp.concatenate(_pack_logprobs(lp), axis=1)


def first_token(logits, position, sampling, stop_tokens, stop_valid, remaining, *, logprobs: int | None = None):
  """The target's own first token after a prompt, and whether it already ends the request.

  Returns:
    (row DecodeState, int32[1, 2 + (1 + 2 logprobs)]: the token, whether the request goes on, then
    the token's log-probabilities packed as ``pack_output`` packs them), the second read by the
    host with one copy (``unpack_first``).
  """
  token = verify_lib.draw_tokens(logits[:, None, :], position[:, None], sampling)[:, 0]
  is_stop = jnp.any((stop_tokens == token[:, None]) & stop_valid, axis=1)
  active = ~is_stop & (remaining > 1)
  columns = [token[:, None], active.astype(jnp.int32)[:, None]]
  if logprobs is not None:
    nodes = jnp.zeros((token.shape[0], 1), jnp.int32)
    columns += _pack_logprobs(logprobs_lib.token_logprobs(logits[:, None, :], nodes, token[:, None], logprobs))
  return DecodeState(root=token, active=active, remaining=remaining - 1), jnp.concatenate(columns, axis=1)


def unpack_first(packed: np.ndarray, top_n: int | None = None):
  """(token, goes on, TokenLogprobs of one token or None) from ``first_token``'s packed row."""
  lp = None if top_n is None else _unpack_logprobs(packed[:, 2:], 1, top_n)
  return int(packed[0, 0]), bool(packed[0, 1]), lp


def _on_leaves(fn, params_def, params_leaves, *args):
  """Calls ``fn(target, drafter_params, *args)`` from the flat leaves of both.

  The engine hands compiled steps the parameters as a flat list of arrays: flattening NNX
  modules on every call costs host time that a decode step cannot spare.
  """
  target, drafter_params = jax.tree.unflatten(params_def, params_leaves)
  return fn(target, drafter_params, *args)


def set_row(decode: DecodeState, row, new: DecodeState) -> DecodeState:
  """Places a one-row DecodeState at ``row`` (int32[1]) of the batch."""
  return jax.tree.map(lambda full, one: full.at[row].set(one), decode, new)


def regather_rows(decode: DecodeState, source_rows, keep) -> DecodeState:
  """A batch of another bucket size: row i takes ``decode[source_rows[i]]``, inactive unless ``keep[i]``.

  Args:
    source_rows: int32[B_new] rows of the old batch; keep: bool[B_new].
  """
  taken = jax.tree.map(lambda a: a[source_rows], decode)
  return dataclasses.replace(taken, active=taken.active & keep)


@dataclasses.dataclass
class StepStats:
  """Per-step statistics of ``generate`` (lists hold one entry per active request).

  Attributes:
    budget: tree budget of the step.
    accepted: accepted length (accepted drafts + 1) per request.
    tree_size: real tree nodes (root included) per request.
    sibling_accepts: accepted draft tokens of rank > 0 per request.
    step_time: wall seconds between this step's results and the previous step's.
    host_time: seconds of that the host spent dispatching and bookkeeping.
    experts_touched: distinct (layer, expert) pairs the verify forward touched.
  """

  budget: int
  accepted: list
  tree_size: list
  sibling_accepts: list
  step_time: float
  host_time: float
  experts_touched: int

  @property
  def host_share(self) -> float:
    return self.host_time / self.step_time if self.step_time > 0 else 0.0


@dataclasses.dataclass
class GenerateResult:
  tokens: list  # per prompt, the generated token ids (stop token included when hit)
  steps: list  # StepStats
  finish_reasons: list  # per prompt: "stop" or "length"
  prefill_time: float
  decode_time: float
  # Per prompt, one logprobs.TokenLogprob per generated token; None unless the decoder computes them.
  logprobs: list | None = None

  @property
  def mean_accepted_length(self) -> float:
    """tau: mean accepted length per request per step (budget-0 steps count 1)."""
    lengths = [a for s in self.steps for a in s.accepted]
    return float(np.mean(lengths)) if lengths else 0.0

  @property
  def host_share(self) -> float:
    total = sum(s.step_time for s in self.steps)
    return sum(s.host_time for s in self.steps) / total if total > 0 else 0.0


def _fresh_seeds(seed, count: int):
  """``seed``, or for None one fresh seed in [0, 2**32) per request."""
  return np.random.default_rng().integers(0, 2**32, count) if seed is None else seed


def _sampling_rows(sampling: verify_lib.SamplingParams, rows, pad_to: int) -> verify_lib.SamplingParams:
  """Host-side selection and zero padding of sampling rows (no device op, so nothing compiles)."""
  def pick(a):
    a = np.asarray(a)[rows]
    return np.concatenate([a, np.zeros((pad_to - len(a),), a.dtype)])
  return jax.tree.map(pick, sampling)


class SpeculativeDecoder:
  """Compiled speculative decoding over a target, a drafter and a tree policy.

  Args:
    target: the Kimi model (an NNX module; its parameters are passed to every compiled step).
    drafter: a ``Drafter``; ``drafter_params`` its parameters (pytree or None).
    policy: a registered policy name (``ddtree``, ``chain``, ``beam``, ``static``, ...) or callable;
      ``policy_options`` are bound to it.
    budgets: the budgets to compile (0 = autoregressive); ``generate`` may use any of them.
    batch_buckets: batch sizes to compile; a batch runs in the smallest bucket that holds it.
    bucket_budgets: optional ``{bucket: budget or [budgets]}``: compile only these steps (a server
      that picks the budget by batch size needs one per bucket); default every bucket x budget.
    max_len: cache columns per slot (prompt + generated + one verify window must fit).
    num_slots: cache slots (at least the largest bucket).
    prefill_chunk: prompt chunk size (one compiled prefill per chunk size).
    compile_cache_dir: jax's persistent compilation cache directory (None: leave as configured).
    max_stop_tokens: stop ids per request the compiled step accepts.
    logprobs: None (the default) computes no log-probabilities; n >= 0 makes every step return
      each emitted token's log-probability under the target and its node's n most likely tokens
      with theirs (``ddtree_jax.logprobs``; requests read them from ``Request.logprobs``, those
      made with ``request(..., logprobs=False)`` keep none). Static: it is compiled into the steps,
      and costs a logsumexp over the vocabulary per tree node, and a top-n per node when n > 0.
    eager: run the step functions uncompiled (for ``jax.disable_jit()`` comparisons).
  """

  def __init__(self, target: KimiModel, drafter, drafter_params=None, *, policy="ddtree",
               policy_options: dict | None = None, budgets: Sequence[int] = (0, 8),
               batch_buckets: Sequence[int] = (1,), bucket_budgets: dict | None = None, max_len: int = 1024, num_slots: int | None = None,
               prefill_chunk: int = 64, compile_cache_dir: str | None = None, max_stop_tokens: int = 4,
               logprobs: int | None = None, show_progress: bool = True, eager: bool = False):
    if compile_cache_dir:
      jax.config.update("jax_compilation_cache_dir", str(compile_cache_dir))
    self.target = target
    self.cfg = target.cfg
    self.drafter = drafter
    self.drafter_params = drafter_params
    if hasattr(drafter, "check_params"):
      try:
        drafter.check_params(drafter_params)
      except ValueError as err:
        raise EngineError(f"drafter_params: {err}") from None
    self.policy_name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    if not (isinstance(policy, str) or callable(policy)):
      raise EngineError(f"policy must be a registered name or a callable, got {policy!r}")
    try:
      self.policy = (policies.get_policy(policy, **(policy_options or {})) if isinstance(policy, str)
                     else policies.bind_options(policy, self.policy_name, policy_options or {}))
    except ValueError as err:
      raise EngineError(str(err)) from None
    for name, values, low in (("budgets", budgets, 0), ("batch_buckets", batch_buckets, 1)):
      if not isinstance(values, (Sequence, np.ndarray)) or isinstance(values, str) or len(values) == 0 or any(
          isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low for v in values):
        raise EngineError(f"{name} must be a non-empty list of ints >= {low}, got {values!r}")
    self.budgets = tuple(sorted(set(int(b) for b in budgets)))
    self.batch_buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
    self.max_batch = self.batch_buckets[-1]
    self.step_shapes = self._step_shapes(bucket_budgets)
    self.num_slots = self.max_batch if num_slots is None else num_slots
    if self.num_slots < self.max_batch:
      raise EngineError(f"num_slots={self.num_slots} is smaller than the largest batch bucket {self.max_batch}")
    self.max_q_len = max(self.budgets) + 1
    self.max_len = max_len
    # The smallest request: one prompt token and one new token, then the verify window.
    if not isinstance(max_len, (int, np.integer)) or max_len < self.max_q_len + 2:
      raise EngineError(f"max_len={max_len!r} cannot hold a prompt token, a new token and the verify window of "
                        f"budget {max(self.budgets)} ({self.max_q_len} rows): it needs at least {self.max_q_len + 2}")
    # Real tree nodes never pass a request's last token, so requests reach max_len - window positions.
    if max_len - self.max_q_len > self.cfg.max_position_embeddings:
      raise EngineError(f"max_len={max_len} lets a request run to {max_len - self.max_q_len} tokens (max_len minus the "
                        f"verify window), past the model's max_position_embeddings {self.cfg.max_position_embeddings}")
    if not 0 < prefill_chunk <= max_len:
      raise EngineError(f"prefill_chunk={prefill_chunk} must lie in [1, max_len={max_len}]")
    self.prefill_chunk = prefill_chunk
    if isinstance(max_stop_tokens, bool) or not isinstance(max_stop_tokens, int) or max_stop_tokens < 1:
      raise EngineError(f"max_stop_tokens={max_stop_tokens!r} must be an int >= 1 (the default stop is EOS)")
    self.max_stop_tokens = max_stop_tokens
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer))
                                 or not 0 <= logprobs <= self.cfg.vocab_size):
      raise EngineError(f"logprobs={logprobs!r} must be None (none computed) or an int in [0, vocab size "
                        f"{self.cfg.vocab_size}]: the alternatives returned per token")
    self.logprobs = None if logprobs is None else int(logprobs)
    # Candidates per position: a budget-N policy may pick up to rank N - 1 at one position.
    self.top_k = max(1, min(max(self.budgets), self.cfg.vocab_size))
    self.pool = cache_lib.SlotPool(self.num_slots, max_len)
    # The target's pool may hold more columns than max_len (never used): the Pallas kernel's length.
    self.target_pool_len = max_len
    if self.cfg.attention_impl == "pallas":
      from pallas_kernels import tree_attention  # the Mosaic GPU kernel; only this path needs it
      self.target_pool_len = tree_attention.padded_cache_len(max_len)
    self.target_cache = cache_lib.init_cache(self.cfg, self.num_slots, self.target_pool_len)
    self.drafter_state = drafter.init_state(self.num_slots, max_len)
    self.eager = eager
    self._params_leaves, self._params_def = jax.tree.flatten((target, drafter_params))
    self._aux: dict[Any, Any] = {}
    self.compile_seconds = 0.0
    self.compile(show_progress=show_progress)

  # ---- compilation -----------------------------------------------------------------------
  def _rows(self, n, dtype):
    return jax.ShapeDtypeStruct((n,), dtype)

  def _decode_spec(self, n):
    return DecodeState(root=self._rows(n, jnp.int32), active=self._rows(n, jnp.bool_),
                       remaining=self._rows(n, jnp.int32))

  def _sampling_spec(self, n):
    return verify_lib.SamplingParams(temperature=self._rows(n, jnp.float32), top_k=self._rows(n, jnp.int32),
                                     top_p=self._rows(n, jnp.float32), seed=self._rows(n, jnp.uint32))

  def _build(self, key, fn, donate, *specs):
    """Compiles ``fn`` for ``specs`` ahead of time (or keeps it uncompiled when eager), float32
    models at full matmul precision (``forward.matmul_precision``)."""
    if self.eager:  # run op by op, under the same precision as the compiled step
      def eager_fn(*args):
        with fwd.matmul_precision(self.cfg):
          return fn(*args)
      self._aux[key] = eager_fn
      return
    with fwd.matmul_precision(self.cfg):
      self._aux[key] = jax.jit(fn, donate_argnums=donate).lower(*specs).compile()

  def _step_shapes(self, bucket_budgets) -> tuple[tuple[int, int], ...]:
    """The (bucket, budget) pairs to compile."""
    if bucket_budgets is None:
      return tuple((bucket, budget) for bucket in self.batch_buckets for budget in self.budgets)
    if set(bucket_budgets) != set(self.batch_buckets):
      raise EngineError(f"bucket_budgets has buckets {sorted(bucket_budgets)}, expected the batch buckets "
                        f"{list(self.batch_buckets)}")
    shapes = []
    for bucket in self.batch_buckets:
      chosen = bucket_budgets[bucket]
      for budget in ([chosen] if np.ndim(chosen) == 0 else chosen):
        if budget not in self.budgets:
          raise EngineError(f"bucket_budgets[{bucket}] = {budget} is not among budgets {list(self.budgets)}")
        shapes.append((bucket, int(budget)))
    return tuple(shapes)

  def compile(self, show_progress: bool = True):
    """Compiles every (batch bucket, budget) step and the admission pieces, ahead of time."""
    t0 = time.perf_counter()
    work = list(self.step_shapes)
    bar = tqdm(work, desc="compiling steps", disable=not show_progress, leave=False)
    for bucket, budget in bar:
      bar.set_postfix(batch=bucket, budget=budget)
      fn = functools.partial(_on_leaves, functools.partial(
          packed_step, drafter=self.drafter, policy=self.policy, budget=budget, top_k=self.top_k,
          logprobs=self.logprobs),
                             self._params_def)
      stops = jax.ShapeDtypeStruct((bucket, self.max_stop_tokens), jnp.int32)
      self._build(("step", bucket, budget), fn, (1, 2, 3), self._params_leaves, self.target_cache,
                  self.drafter_state, self._decode_spec(bucket), self._rows(bucket, jnp.int32),
                  self._sampling_spec(bucket), stops, jax.ShapeDtypeStruct(stops.shape, jnp.bool_))
    one = lambda dtype: self._rows(1, dtype)
    self._build("prefill", functools.partial(_on_leaves, functools.partial(prefill_step, drafter=self.drafter),
                                             self._params_def), (1, 2), self._params_leaves,
                self.target_cache, self.drafter_state,
                jax.ShapeDtypeStruct((1, self.prefill_chunk), jnp.int32), one(jnp.int32), one(jnp.int32))
    if self.logprobs is not None:
      self._build("prefill_logprobs", functools.partial(_on_leaves, functools.partial(
          prefill_logprobs_step, drafter=self.drafter, logprobs=self.logprobs), self._params_def), (1, 2),
                  self._params_leaves, self.target_cache, self.drafter_state,
                  jax.ShapeDtypeStruct((1, self.prefill_chunk), jnp.int32), one(jnp.int32), one(jnp.int32),
                  jax.ShapeDtypeStruct((1, self.prefill_chunk), jnp.int32))
    stops = jax.ShapeDtypeStruct((1, self.max_stop_tokens), jnp.int32)
    self._build("first", functools.partial(first_token, logprobs=self.logprobs), (),
                jax.ShapeDtypeStruct((1, self.cfg.vocab_size), jnp.float32), one(jnp.int32), self._sampling_spec(1),
                stops, jax.ShapeDtypeStruct(stops.shape, jnp.bool_), one(jnp.int32))
    for bucket in self.batch_buckets:
      self._build(("set_row", bucket), set_row, (0,), self._decode_spec(bucket), one(jnp.int32), self._decode_spec(1))
      for other in self.batch_buckets:
        if other != bucket:
          self._build(("regather", bucket, other), regather_rows, (), self._decode_spec(bucket),
                      self._rows(other, jnp.int32), self._rows(other, jnp.bool_))
    self._build("reset_lengths", cache_lib.reset_slots, (0,), self.target_cache, one(jnp.int32))
    if hasattr(self.drafter, "reset_slot"):
      self._build("drafter_reset", self.drafter.reset_slot, (0,), self.drafter_state, one(jnp.int32))
    self._build("fresh_caches", lambda: (cache_lib.init_cache(self.cfg, self.num_slots, self.target_pool_len),
                                         self.drafter.init_state(self.num_slots, self.max_len)), ())
    self.compile_seconds += time.perf_counter() - t0

  def reset_caches(self) -> None:
    """Empty caches (after a failed step; every request in them has been ended by the caller)."""
    self.target_cache, self.drafter_state = self._aux["fresh_caches"]()

  def bucket_for(self, batch_size: int) -> int:
    for bucket in self.batch_buckets:
      if bucket >= batch_size:
        return bucket
    raise EngineError(f"batch of {batch_size} exceeds the largest compiled batch bucket {self.max_batch}")

  # ---- validation --------------------------------------------------------------------------
  def check_budget(self, budget, bucket: int | None = None) -> int:
    """``budget`` as an int if a step was compiled for it (for ``bucket``, when given)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
      raise EngineError(f"budget must be an int, got {budget!r}")
    if budget not in self.budgets:
      if budget > max(self.budgets):
        raise EngineError(f"budget {budget} is above the compiled maximum {max(self.budgets)} "
                          f"(compiled budgets: {list(self.budgets)})")
      raise EngineError(f"budget {budget} was not compiled (compiled budgets: {list(self.budgets)})")
    if bucket is not None and (bucket, budget) not in self.step_shapes:
      compiled = sorted(b for k, b in self.step_shapes if k == bucket)
      raise EngineError(f"budget {budget} was not compiled for batch bucket {bucket} (compiled: {compiled})")
    return int(budget)

  def _check_prompts(self, prompts, max_new_tokens):
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:  # equal-length prompts as one array
      prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
      raise EngineError("prompts must be a non-empty list of token-id sequences")
    limits = (list(max_new_tokens) if np.ndim(max_new_tokens) == 1 else [max_new_tokens] * len(prompts))
    if len(limits) != len(prompts):
      raise EngineError(f"max_new_tokens has {len(limits)} entries for {len(prompts)} prompts")
    out = []
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
      if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit <= 0:
        raise EngineError(f"max_new_tokens must be a positive int, got {limit!r}")
      try:
        arr = np.asarray(prompt)
      except ValueError:
        raise EngineError(f"prompt {i} must be a flat list of token ids") from None
      if arr.ndim != 1 or arr.size == 0:
        raise EngineError(f"prompt {i} is empty (or not a flat list of token ids)")
      if not np.issubdtype(arr.dtype, np.integer):
        raise EngineError(f"prompt {i} must hold integer token ids, got {arr.dtype}")
      if arr.min() < 0 or arr.max() >= self.cfg.vocab_size:
        raise EngineError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
      need = arr.size + int(limit) + self.max_q_len
      if need > self.max_len:
        raise EngineError(
            f"prompt {i} is too long for the cache: {arr.size} prompt tokens + max_new_tokens "
            f"{int(limit)} + verify window {self.max_q_len} = {need} > max_len {self.max_len}")
      out.append(arr.astype(np.int32))
    return out, [int(l) for l in limits]

  def _stop_arrays(self, stop_token_ids, batch):
    if stop_token_ids is None:
      stop_ids = [self.cfg.eos_token_id]
    elif np.ndim(stop_token_ids) == 1 or (isinstance(stop_token_ids, Sequence) and len(stop_token_ids) == 0):
      stop_ids = list(stop_token_ids)
    else:
      raise EngineError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
    if len(stop_ids) > self.max_stop_tokens:
      raise EngineError(f"{len(stop_ids)} stop token ids exceed max_stop_tokens={self.max_stop_tokens}")
    for t in stop_ids:
      if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
        raise EngineError(f"stop token ids must be ints, got {t!r}")
      if not 0 <= int(t) < self.cfg.vocab_size:
        raise EngineError(f"stop token id {t} outside [0, {self.cfg.vocab_size})")
    tokens = np.zeros((batch, self.max_stop_tokens), np.int32)
    valid = np.zeros((batch, self.max_stop_tokens), bool)
    tokens[:, :len(stop_ids)] = stop_ids
    valid[:, :len(stop_ids)] = True
    return tokens, valid

  # ---- admission ---------------------------------------------------------------------------
  def _admit(self, prompt: np.ndarray, row: int, decode: DecodeState, sampling_row, stop_row, stop_valid_row,
             max_new_tokens: int, prompt_logprobs: bool = False):
    """Prefills one request into a fresh slot and places it at ``row`` of the batch state.

    Returns (slot, first token's packed row (``first_token``), decode, the prompt chunks' packed
    log-probabilities (``prefill_logprobs_step``; empty unless ``prompt_logprobs``)), all on the
    device: nothing here waits for the device.
    """
    slot = self.pool.allocate()
    try:
      return slot, *self._prefill_into(slot, prompt, row, decode, sampling_row, stop_row, stop_valid_row,
                                       max_new_tokens, prompt_logprobs)
    except BaseException:
      self.pool.release(slot)
      raise

  def _prefill_into(self, slot, prompt, row, decode, sampling_row, stop_row, stop_valid_row, max_new_tokens,
                    prompt_logprobs):
    slot_dev = np.asarray([slot], np.int32)
    self.target_cache = self._aux["reset_lengths"](self.target_cache, slot_dev)
    if "drafter_reset" in self._aux:
      self.drafter_state = self._aux["drafter_reset"](self.drafter_state, slot_dev)
    else:
      self.drafter_state = self.drafter.reset(self.drafter_params, self.drafter_state, slot_dev, prompt)
    chunk = self.prefill_chunk
    logits = None
    prompt_chunks = []
    for offset in range(0, len(prompt), chunk):
      piece = prompt[offset:offset + chunk]
      tokens = np.zeros((1, chunk), np.int32)
      tokens[0, :len(piece)] = piece
      args = (self._params_leaves, self.target_cache, self.drafter_state, tokens, np.asarray([len(piece)], np.int32),
              slot_dev)
      if prompt_logprobs:
        following = prompt[offset + 1:offset + chunk + 1]
        next_tokens = np.zeros((1, chunk), np.int32)
        next_tokens[0, :len(following)] = following
        self.target_cache, self.drafter_state, logits, packed = self._aux["prefill_logprobs"](*args, next_tokens)
        prompt_chunks.append(packed)
      else:
        self.target_cache, self.drafter_state, logits = self._aux["prefill"](*args)
    self.pool.record_commit([slot], [len(prompt)])
    row_state, first = self._aux["first"](logits, np.asarray([len(prompt) - 1], np.int32), sampling_row,
                                          stop_row, stop_valid_row, np.asarray([max_new_tokens], np.int32))
    decode = self._aux[("set_row", decode.root.shape[0])](decode, np.asarray([row], np.int32), row_state)
    return first, decode, prompt_chunks

  # ---- generation --------------------------------------------------------------------------
  def request(self, prompt, max_new_tokens: int, *, temperature=0.0, top_k=0, top_p=1.0, seed=None,
              stop_token_ids: Sequence[int] | None = None, logprobs: bool = True,
              prompt_logprobs: bool = False) -> "Request":
    """A validated request (raises EngineError/ValueError naming the bad argument); ``seed`` as in
    ``generate``. ``logprobs``: keep its tokens' log-probabilities on the host (when the decoder
    computes them); a server sets it per request, since building them costs host time a step.
    ``prompt_logprobs``: also each prompt token's after the first (``Request.prompt_logprobs``;
    its prefill then computes every position's logits)."""
    if prompt_logprobs and self.logprobs is None:
      raise EngineError("prompt_logprobs needs a decoder that computes log-probabilities "
                        "(SpeculativeDecoder(logprobs=n))")
    (arr,), (limit,) = self._check_prompts([prompt], [max_new_tokens])
    sampling = verify_lib.SamplingParams.make(1, temperature=temperature, top_k=top_k, top_p=top_p,
                                              seed=_fresh_seeds(seed, 1))
    stop_tokens, stop_valid = self._stop_arrays(stop_token_ids, 1)
    return Request(prompt=arr, max_new_tokens=limit, sampling=sampling, stop_tokens=stop_tokens[0],
                   stop_valid=stop_valid[0], want_logprobs=bool(logprobs),
                   want_prompt_logprobs=bool(prompt_logprobs))

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens, *, budget: int | None = None,
               budget_schedule: Callable[[int], int] | None = None, temperature=0.0, top_k=0, top_p=1.0,
               seed=None, stop_token_ids: Sequence[int] | None = None) -> GenerateResult:
    """Generates for a list of prompts with continuous batching (sampling settings per request).

    Requests run in the smallest compiled bucket that holds them all, or the largest bucket, in
    which case a request joins as soon as another leaves.

    Args:
      max_new_tokens: an int, or one per prompt.
      budget: tree budget for every step (default: the largest compiled one).
      budget_schedule: optional ``step_index -> budget`` (for example to switch budgets mid-run).
      temperature, top_k, top_p, seed: scalars or one value per prompt. A sample is a function of
        (seed, position) only, so equal seeds give equal samples of equal prompts; a scalar seed
        is every request's seed, so the rows share their noise (different prompts' samples are
        then correlated: pass one seed per prompt for independent, reproducible rows);
        ``seed=None`` (the default) draws a fresh seed per request, as the server does for a
        request without one.
      stop_token_ids: ids that end a request (default: the model's EOS); the stop token is kept.
    """
    prompts, limits = self._check_prompts(prompts, max_new_tokens)
    count = len(prompts)
    bucket = self.bucket_for(min(count, self.max_batch))
    default_budget = self.check_budget(
        max(b for k, b in self.step_shapes if k == bucket) if budget is None else budget, bucket)
    sampling = verify_lib.SamplingParams.make(count, temperature=temperature, top_k=top_k, top_p=top_p,
                                              seed=_fresh_seeds(seed, count))
    stop_tokens, stop_valid = self._stop_arrays(stop_token_ids, count)
    requests = [Request(prompt=prompts[i], max_new_tokens=limits[i], sampling=_sampling_rows(sampling, [i], 1),
                        stop_tokens=stop_tokens[i], stop_valid=stop_valid[i]) for i in range(count)]
    batch = Batch(self, bucket)
    waiting = list(requests)
    steps: list[StepStats] = []
    prefill_time = 0.0
    t_start = time.perf_counter()
    pending = None
    try:
      while waiting or batch.num_running or pending is not None:
        t0 = time.perf_counter()
        while waiting and batch.free_rows():
          batch.admit(waiting.pop(0))
        prefill_time += time.perf_counter() - t0
        dispatched = None
        if batch.num_running:
          b = (self.check_budget(budget_schedule(len(steps) + (pending is not None)), bucket) if budget_schedule
               else default_budget)
          dispatched = batch.dispatch(b)
        if pending is not None:
          steps.append(batch.collect(pending))
        pending = dispatched
        if pending is not None and not batch.num_running and not waiting:
          # Dispatched while the last requests were finishing on the device: it emits nothing.
          jax.block_until_ready(pending[1])
          pending = None
    finally:
      batch.close()
    return GenerateResult(tokens=[r.tokens for r in requests], steps=steps,
                          finish_reasons=[r.finish_reason for r in requests], prefill_time=prefill_time,
                          decode_time=time.perf_counter() - t_start - prefill_time,
                          logprobs=None if self.logprobs is None else [r.logprobs for r in requests])


@dataclasses.dataclass(eq=False)
class Request:
  """One request's inputs and, as it runs, its output."""

  prompt: np.ndarray
  max_new_tokens: int
  sampling: verify_lib.SamplingParams  # one row (numpy)
  stop_tokens: np.ndarray  # int32[max_stop_tokens]
  stop_valid: np.ndarray  # bool[max_stop_tokens]
  tokens: list = dataclasses.field(default_factory=list)
  # One logprobs.TokenLogprob per token of ``tokens`` when the decoder computes them and
  # ``want_logprobs``, else empty.
  logprobs: list = dataclasses.field(default_factory=list)
  want_logprobs: bool = True
  # With ``want_prompt_logprobs``, one TokenLogprob per prompt token after the first, filled by the
  # first ``collect`` after admission (with the first token).
  prompt_logprobs: list = dataclasses.field(default_factory=list)
  want_prompt_logprobs: bool = False
  # "stop" or "length" once finished; "cancelled" when ``Batch.cancel`` ended it (a caller may
  # pass its own reason, for example "stop" for a stop string the host found).
  finish_reason: str | None = None
  slot: int | None = None  # its cache slot while it runs
  # The first token, whether the request goes on after it and the token's logprobs (packed by
  # ``first_token``), on the device until the first ``collect`` that covers the request reads it
  # (admission never waits for the device).
  first: jax.Array | None = None
  prompt_chunks: list = dataclasses.field(default_factory=list)  # on the device until then too

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  def finish(self) -> None:
    stops = set(self.stop_tokens[self.stop_valid].tolist())
    self.finish_reason = "stop" if self.tokens and self.tokens[-1] in stops else "length"


def _prompt_entries(chunks, top_n: int, count: int) -> list:
  """The first ``count`` TokenLogprobs of a prompt's packed chunks (``prefill_logprobs_step``)."""
  entries = []
  for packed in chunks:
    q_len = packed.shape[1] // (1 + 2 * top_n)
    entries += logprobs_lib.host_entries(_unpack_logprobs(packed, q_len, top_n), 0, q_len)
  return entries[:count]


class Batch:
  """A running batch of one compiled bucket: requests join free rows and leave when finished.

  The host dispatches step k + 1 before it reads step k (``dispatch`` then ``collect``); a row
  that finished on the device during step k + 1 simply emits nothing there. Finished requests
  free their cache slot at once; a new request may take the row before the next dispatch.
  ``cancel`` ends a request at any time and ``resize`` moves the running rows to another bucket;
  neither waits for the device, and a step still in flight is read back by request, not by row.
  """

  def __init__(self, decoder: "SpeculativeDecoder", bucket: int):
    if bucket not in decoder.batch_buckets:
      raise EngineError(f"batch bucket {bucket!r} was not compiled (compiled buckets: {list(decoder.batch_buckets)})")
    self.decoder = decoder
    self.bucket = bucket
    self.rows: list[Request | None] = [None] * bucket
    self.slots = np.full((bucket,), decoder.pool.scratch_slot, np.int32)
    zeros = lambda dtype: np.zeros((bucket,), dtype)
    self.sampling = verify_lib.SamplingParams(temperature=zeros(np.float32), top_k=zeros(np.int32),
                                              top_p=np.ones((bucket,), np.float32), seed=zeros(np.uint32))
    self.stop_tokens = np.zeros((bucket, decoder.max_stop_tokens), np.int32)
    self.stop_valid = np.zeros((bucket, decoder.max_stop_tokens), bool)
    self.decode = jax.device_put(DecodeState(root=zeros(np.int32), active=zeros(bool), remaining=zeros(np.int32)))
    self._device_inputs = None  # slots, sampling and stops on the device, refreshed when rows change
    self._last_ready = None  # when the previous step's results were read (step wall time)

  @property
  def num_running(self) -> int:
    return sum(r is not None for r in self.rows)

  def running(self) -> list[Request]:
    return [r for r in self.rows if r is not None]

  def free_rows(self) -> list[int]:
    return [i for i, r in enumerate(self.rows) if r is None]

  def admit(self, request: Request) -> None:
    """Prefills ``request`` into a free row; its first token is read by the next ``collect``."""
    free = self.free_rows()
    if not free:
      raise EngineError(f"no free row: all {self.bucket} rows of the batch are running (admit after one leaves)")
    row = free[0]
    slot, first, self.decode, prompt_chunks = self.decoder._admit(  # pylint: disable=protected-access
        request.prompt, row, self.decode, request.sampling, request.stop_tokens[None], request.stop_valid[None],
        request.max_new_tokens, request.want_prompt_logprobs)
    request.slot, request.first, request.prompt_chunks = slot, first, prompt_chunks
    self.rows[row] = request
    self.slots[row] = slot
    for field in ("temperature", "top_k", "top_p", "seed"):
      getattr(self.sampling, field)[row] = getattr(request.sampling, field)[0]
    self.stop_tokens[row], self.stop_valid[row] = request.stop_tokens, request.stop_valid
    self._device_inputs = None
    for array in (first, *prompt_chunks):
      array.copy_to_host_async()  # read by the next collect, as a step's output is

  def _leave(self, request: Request) -> None:
    """Frees the request's row and slot (it has finished or was cancelled)."""
    row = self.rows.index(request)
    self.decoder.pool.release(request.slot)
    request.slot = None
    request.first, request.prompt_chunks = None, []  # a step in flight keeps its own reference
    self.rows[row] = None
    self.slots[row] = self.decoder.pool.scratch_slot
    self._device_inputs = None
    return row

  def cancel(self, request: Request, reason: str = "cancelled") -> None:
    """Ends a running request now: its row stops on the device and its slot is free at once.

    A step already in flight may still compute the row; ``collect`` drops what it emits, and the
    slot's next owner resets it in a prefill that the device runs after that step.
    """
    if request.finished:
      return
    request.finish_reason = reason
    row = self._leave(request)
    stopped = DecodeState(root=np.zeros((1,), np.int32), active=np.zeros((1,), bool),
                          remaining=np.zeros((1,), np.int32))
    self.decode = self.decoder._aux[("set_row", self.bucket)](  # pylint: disable=protected-access
        self.decode, np.asarray([row], np.int32), stopped)

  def resize(self, bucket: int) -> None:
    """Moves the running rows to a batch of ``bucket`` rows (compiled steps exist for each bucket)."""
    if bucket == self.bucket:
      return
    running = [i for i, r in enumerate(self.rows) if r is not None]
    if len(running) > bucket:
      raise EngineError(f"cannot resize a batch of {len(running)} running requests to {bucket} rows")
    source = np.zeros((bucket,), np.int32)
    source[:len(running)] = running
    keep = np.arange(bucket) < len(running)
    self.decode = self.decoder._aux[("regather", self.bucket, bucket)](  # pylint: disable=protected-access
        self.decode, source, keep)
    pick = lambda a, fill: np.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a[source], fill)
    self.rows = [self.rows[i] for i in running] + [None] * (bucket - len(running))
    self.slots = pick(self.slots, self.decoder.pool.scratch_slot).astype(np.int32)
    self.sampling = verify_lib.SamplingParams(
        temperature=pick(self.sampling.temperature, 0.0).astype(np.float32),
        top_k=pick(self.sampling.top_k, 0).astype(np.int32), top_p=pick(self.sampling.top_p, 1.0).astype(np.float32),
        seed=pick(self.sampling.seed, 0).astype(np.uint32))
    self.stop_tokens = pick(self.stop_tokens, 0).astype(np.int32)
    self.stop_valid = pick(self.stop_valid, False)
    self.bucket = bucket
    self._device_inputs = None

  def mark_idle(self) -> None:
    """Nothing is in flight: the next step's wall time counts from its own dispatch."""
    self._last_ready = None

  def dispatch(self, budget: int):
    """Enqueues one step; returns a handle for ``collect``. Never waits on the device."""
    host_t0 = time.perf_counter()
    if self._last_ready is None:
      self._last_ready = host_t0
    if self._device_inputs is None:
      # Copies: on the CPU device_put may alias an aligned numpy buffer instead of copying it, and
      # admit/_leave edit these arrays in place while this step can still be queued (a cancelled
      # row would then run against the slot written after it, e.g. the scratch slot).
      self._device_inputs = jax.device_put(jax.tree.map(np.copy, (self.slots, self.sampling, self.stop_tokens,
                                                                  self.stop_valid)))
    d = self.decoder
    step = d._aux.get(("step", self.bucket, budget))  # pylint: disable=protected-access
    if step is None:
      d.check_budget(budget, self.bucket)  # raises, naming what was compiled
    d.target_cache, d.drafter_state, self.decode, out = step(
        d._params_leaves, d.target_cache, d.drafter_state, self.decode, *self._device_inputs)  # pylint: disable=protected-access
    # Started now, the copy runs as soon as the step ends, so ``collect`` finds the tokens on
    # the host instead of waiting for a copy that it asks for only then (on the GPU that wait
    # was 40-50% of a batch-1 plain-decoding step: docs/engine_step.md).
    out.copy_to_host_async()
    return budget, out, list(self.rows), self.slots.copy(), time.perf_counter() - host_t0

  def collect(self, handle) -> StepStats:
    """Reads a dispatched step's tokens (waiting for it), finishes and releases requests."""
    budget, out, rows, slots, host_time = handle
    firsts = {row: (r.first, r.prompt_chunks) for row, r in enumerate(rows) if r is not None and r.first is not None}
    packed, firsts = jax.device_get((out, firsts))
    top_n = self.decoder.logprobs
    host = unpack_output(packed, top_n)
    ready = time.perf_counter()
    stats = StepStats(budget=budget, accepted=[], tree_size=[], sibling_accepts=[],
                      step_time=ready - self._last_ready, host_time=host_time,
                      experts_touched=int(host.experts_touched))
    self._last_ready = ready
    # Python lists, one conversion a field, and one commit call for all rows: at batch 64 on a
    # 2-core CPU per-element numpy reads and a commit call a row took 1.02 ms a step (37% of it the
    # commit calls); this takes 0.41 (docs/engine_step.md).
    emitted, num_emitted, num_accepted, tree_size, sibling_accepts, finished = (
        getattr(host, name).tolist() for name in ("emitted", "num_emitted", "num_accepted", "tree_size",
                                                  "sibling_accepts", "finished"))
    live = []  # (row, request) whose step output counts
    for row, request in enumerate(rows):
      if request is None or request.finished:  # an empty row, or one cancelled since the dispatch
        continue
      if row in firsts:
        first, prompt_chunks = firsts[row]
        token, active, first_lp = unpack_first(first, top_n)
        request.first, request.prompt_chunks = None, []
        if prompt_chunks:
          request.prompt_logprobs = _prompt_entries(prompt_chunks, top_n, len(request.prompt) - 1)
        request.tokens.append(token)
        if first_lp is not None and request.want_logprobs:
          request.logprobs.extend(logprobs_lib.host_entries(first_lp, 0, 1))
        if not active:  # the first token ended it; the row was inactive in this step
          request.finish()
          self._leave(request)
          continue
      live.append((row, request))
    # Before any request below leaves: leaving frees its slot's length.
    self.decoder.pool.record_commit([r.slot for _, r in live], [num_accepted[row] for row, _ in live])
    for row, request in live:
      n = num_emitted[row]
      if n == 0:
        continue
      request.tokens.extend(emitted[row][:n])
      if host.logprobs is not None and request.want_logprobs:
        request.logprobs.extend(logprobs_lib.host_entries(host.logprobs, row, n))
      stats.accepted.append(num_accepted[row])
      stats.tree_size.append(tree_size[row])
      stats.sibling_accepts.append(sibling_accepts[row])
      if finished[row]:
        request.finish()
        self._leave(request)
    stats.host_time += time.perf_counter() - ready
    return stats

  def close(self) -> None:
    """Releases the slots of requests still running (after an error or an abandoned run)."""
    for request in self.running():
      self._leave(request)
