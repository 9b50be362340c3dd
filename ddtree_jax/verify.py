"""Verification of a draft tree: the target's own draw at every node, then the accepted path.

Lossless by construction (DESIGN.md 1.3): ``draw_tokens`` is the only place a token is chosen. At
every node it draws what plain target decoding would draw after that node's prefix (argmax at
temperature 0, else a sample from the processed distribution), with a PRNG key that depends only
on the request's seed and the absolute position of the drawn token. ``accept`` then follows the
draws down the tree. Every emitted token is therefore the target's own draw given its real prefix,
with the key plain seeded decoding would have used: at T = 0 the output is token-identical to
greedy decoding, and at T > 0 a seeded request emits exactly what seeded autoregressive sampling
emits, whatever the batch it shares or the budget of the step. (Given the same logits: in float32
they are; in bf16 the target's logits themselves round differently with the window's shape, the
README's bf16 open problem.)

Shapes: ``B`` batch rows, ``Q = budget + 1`` tree nodes, ``V`` vocabulary, ``S`` stop tokens.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.tree import Tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling settings (a pytree; every field is ``[B]``, numpy from ``make``).

  Attributes:
    temperature: float32; 0 means greedy (argmax).
    top_k: int32; keep the k most likely tokens, 0 means off (k >= V is also a no-op).
    top_p: float32 in (0, 1]; nucleus mass, 1 means off.
    seed: uint32; the request's PRNG seed (unused by greedy rows).
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array

  @property
  def batch_size(self) -> int:
    return self.temperature.shape[0]

  @classmethod
  def make(cls, batch_size: int, temperature=0.0, top_k=0, top_p=1.0, seed=0) -> "SamplingParams":
    """Host constructor: each argument is a scalar (broadcast) or a sequence of ``batch_size``.

    Validation happens here, on the host, because a bad value inside a compiled step would only
    show up as silently wrong samples. Raises ValueError naming the offending argument.
    """
    if int(batch_size) != batch_size or batch_size < 0:
      raise ValueError(f"SamplingParams.make: batch_size={batch_size!r} must be a non-negative int")
    temperature = _per_request("temperature", temperature, batch_size, np.float64)
    top_k = _per_request("top_k", top_k, batch_size, np.float64)
    top_p = _per_request("top_p", top_p, batch_size, np.float64)
    seed = _per_request("seed", seed, batch_size, np.float64)
    if np.any(temperature < 0) or not np.all(np.isfinite(temperature)):
      raise ValueError(
          f"SamplingParams.make: temperature must be finite and >= 0, got {temperature}")
    if np.any(top_k < 0) or np.any(top_k != np.round(top_k)) or np.any(top_k >= 2**31):
      raise ValueError(f"SamplingParams.make: top_k must be an integer >= 0, got {top_k}")
    if not np.all((top_p > 0) & (top_p <= 1)):  # NaN fails both comparisons
      raise ValueError(f"SamplingParams.make: top_p must lie in (0, 1], got {top_p}")
    if np.any(seed < 0) or np.any(seed >= 2**32) or np.any(seed != np.round(seed)):
      raise ValueError(f"SamplingParams.make: seed must be an integer in [0, 2**32), got {seed}")
    # Host numpy arrays of the final dtypes: converting on the device would compile a kernel.
    return cls(
        temperature=temperature.astype(np.float32),
        top_k=top_k.astype(np.int32),
        top_p=top_p.astype(np.float32),
        seed=seed.astype(np.uint64).astype(np.uint32),
    )


def _per_request(name, value, batch_size, dtype):
  """Broadcasts a scalar or checks a sequence's length; NaN is rejected for every argument."""
  try:
    arr = np.asarray(value, dtype=dtype)
  except (TypeError, ValueError) as e:
    raise ValueError(f"SamplingParams.make: {name}={value!r} is not numeric") from e
  if arr.ndim == 0:
    arr = np.full((batch_size,), arr, dtype)
  elif arr.shape != (batch_size,):
    raise ValueError(
        f"SamplingParams.make: {name} has shape {arr.shape}, expected a scalar or ({batch_size},)")
  if np.any(np.isnan(arr)):
    raise ValueError(f"SamplingParams.make: {name} contains NaN: {arr}")
  return arr


def draw_keys(seed, positions):
  """The PRNG key of every draw.

  Args:
    seed: uint32[B].
    positions: int32[B, Q], the node positions; the drawn token sits at ``position + 1``.
  Returns:
    key[B, Q]: ``fold_in(key(seed), position + 1)``. Nothing else goes into a key, so the token at
    absolute position P of a seeded request is drawn with the same key in any batch and budget.
  """
  base = jax.vmap(jax.random.key)(seed)
  fold = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)), in_axes=(0, 0))
  return fold(base, positions + 1)


def process_logits(logits, sampling):
  """Temperature, then top-k, then top-p: the distribution a sampled row draws from.

  Both truncations are value thresholds (one scalar per row, ``-inf`` outside the support), which
  is what makes them shardable over the vocabulary (see ``draw_tokens``). Tokens tied with the
  threshold value are all kept, so top-k may keep more than k tokens and top-p more than the
  smallest nucleus when logits tie exactly at the boundary. top_k = 0 or >= V and top_p = 1 are
  exact no-ops (top_p = 1 does not rely on a cumulative sum reaching 1.0 in float32).

  Args:
    logits: [B, Q, V], any float dtype (computed in float32).
    sampling: SamplingParams with [B] fields.
  Returns:
    float32[B, Q, V]: ``(logits - row max) / T`` with ``-inf`` outside the support (the max
    first, so that a tiny T sends every other token to -inf rather than the top one to +inf or
    NaN). Greedy rows (T = 0) are returned unscaled and untruncated: their argmax is always
    inside any support.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  temp = sampling.temperature[:, None, None]
  sampled = temp > 0
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)  # an all -inf row stays -inf, not NaN
  z = jnp.where(sampled, (logits - top) / jnp.where(sampled, temp, 1.0), logits)

  top_k = sampling.top_k[:, None, None]
  top_p = sampling.top_p[:, None, None]
  k_on = sampled & (top_k > 0) & (top_k < vocab)
  p_on = sampled & (top_p < 1)

  def truncate(z):
    desc = -jnp.sort(-z, axis=-1)
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, vocab - 1), axis=-1)
    k_thresh = jnp.where(k_on, kth, -jnp.inf)
    desc = jnp.where(desc >= k_thresh, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    # Exclusive cumulative mass: a token is in the nucleus iff the mass strictly before it is < p,
    # so the most likely token is always kept.
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.sum(before < top_p, axis=-1, keepdims=True)
    pth = jnp.take_along_axis(desc, jnp.maximum(n_keep - 1, 0), axis=-1)
    p_thresh = jnp.where(p_on, pth, -jnp.inf)
    return jnp.where(z >= jnp.maximum(k_thresh, p_thresh), z, -jnp.inf)

  # The sort is the only super-linear step: all-greedy or untruncated batches skip it.
  return jax.lax.cond(jnp.any(k_on | p_on), truncate, lambda z: z, z)


def gumbel_noise(key, vocab: int):
  """float32[vocab] Gumbel(0, 1) noise for one draw.

  ``mode="high"`` (two 32-bit words a value): jax's default mode maps one 23-bit uniform, which
  caps the noise at 15.94, so a token more than ~16 nats below the top one could almost never be
  drawn: with Kimi's 163840 tokens and every other token 16 nats below the top one, it drew the
  tail 1.0% of the time against the softmax's 1.8%. "high" reaches ~32, where the mass cut off is
  below 1e-8.
  """
  return jax.random.gumbel(key, (vocab,), jnp.float32, mode="high")


def draw_tokens(logits, positions, sampling):
  """The target's own next token at every node: THE one place a token is chosen.

  Greedy rows (temperature 0): ``argmax`` of the logits; ties go to the lowest token id.
  Sampled rows: Gumbel-max, ``argmax(process_logits(...) + g)`` with ``g ~ Gumbel(0, 1)[V]`` drawn
  from ``draw_keys(seed, positions)``, an exact sample of the processed distribution (ties in the
  perturbed values, probability zero, also go to the lowest id).

  How a vocabulary-sharded head computes the same tokens, shard by shard:
    * argmax: each shard reduces its slice to (max, lowest local argmax); one cross-shard reduction
      picks the largest value, lowest global id on ties. Nothing V-sized moves.
    * noise: ``g`` is a fixed function of (key, V) (``gumbel_noise``: bits [2, V]); with
      ``jax_threefry_partitionable`` (default) generating the draw sharded over V gives every
      shard exactly its slice of the unsharded bits, so sharded and unsharded draws agree.
    * the row max that ``process_logits`` subtracts is a pmax.
    * top-k: each shard takes its local top-k values (k <= the largest k served), the S * k values
      are all-gathered and the global k-th largest is the row's threshold.
    * top-p: the global max and normaliser are a pmax and a psum of ``exp(z - max)``; the nucleus
      threshold is where the descending cumulative mass crosses p: with top-k on, computed from the
      gathered candidates (everything else is masked anyway); without it, by bisection on the
      threshold value, one psum of the mass above the candidate per step (32 steps over the
      float32 ordering are exact).
    Only per-row scalars cross shards; masking and perturbing stay local.

  Args:
    logits: [B, Q, V] target logits at every node.
    positions: int32[B, Q], node positions (``tree.positions``); the drawn token sits one later.
    sampling: SamplingParams with [B] fields.
  Returns:
    int32[B, Q] drawn tokens.
  """
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sample(_):
    z = process_logits(logits, sampling)
    keys = draw_keys(sampling.seed, positions)
    noise = jax.vmap(jax.vmap(lambda key: gumbel_noise(key, logits.shape[-1])))(keys)
    drawn = jnp.argmax(z + noise, axis=-1).astype(jnp.int32)
    return jnp.where(sampling.temperature[:, None] > 0, drawn, greedy)

  # All-greedy batches (the common T = 0 serving case) skip the noise and the sort entirely.
  return jax.lax.cond(jnp.any(sampling.temperature > 0), sample, lambda _: greedy, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AcceptResult:
  """Outcome of one verify step (a pytree).

  Padded entries are 0; token id 0 is a real token, so read lengths, never values.

  Attributes:
    accepted_nodes: int32[B, Q], node indices of the accepted path in order, starting with the
      root 0, then padded with 0 beyond ``num_accepted``.
    num_accepted: int32[B], path nodes including the root (accepted draft tokens + 1); 0 for a row
      whose root is invalid. This is what the KV commit uses; a stop token does not shrink it
      (the extra committed KV belongs to a request that is ending anyway).
    bonus: int32[B], the drawn token at the last path node (0 when the root is invalid).
    emitted: int32[B, Q], the accepted draft tokens then the bonus, cut after a stop token.
    num_emitted: int32[B], ``num_accepted`` unless a stop token ended emission early; 0 for a row
      whose root is invalid (finished requests, empty slots).
    hit_stop: bool[B], an emitted token was a stop token (it is the last one emitted).
  """

  accepted_nodes: jax.Array
  num_accepted: jax.Array
  bonus: jax.Array
  emitted: jax.Array
  num_emitted: jax.Array
  hit_stop: jax.Array


def accept(tree: Tree, drawn, stop_tokens=None, stop_valid=None) -> AcceptResult:
  """Follows the target's draws down the tree from the root.

  The walk: at the current node, if the drawn token equals the token of one of its valid
  children, move to that child (sibling tokens are distinct; were they not, the lowest-index
  child would be taken); otherwise stop. Computed without a loop so no data-dependent control
  flow reaches the device: node i is on the path iff it and every ancestor below the root match
  the draw at their parent, an AND over ancestors by pointer doubling (ceil(log2 Q) gathers).
  Parents precede children, so the path in increasing node index is the path in depth order.

  Args:
    tree: Tree with [B, Q] fields; only tokens, parents and valid are read.
    drawn: int32[B, Q], ``draw_tokens`` at every node.
    stop_tokens: optional int32[B, S] stop token ids.
    stop_valid: optional bool[B, S], which stop entries are real (defaults to all of them).
  Returns:
    AcceptResult.
  """
  tokens, parents, valid = tree.tokens, tree.parents, tree.valid
  batch, q_len = tokens.shape
  drawn = drawn.astype(jnp.int32)
  idx = jnp.arange(q_len, dtype=jnp.int32)
  take = jax.vmap(lambda row, i: row[i])

  # A node can only be entered from a real parent that precedes it (this also rules out cycles).
  has_parent = valid & (parents >= 0) & (parents < idx[None, :])
  safe_parent = jnp.where(has_parent, parents, 0)
  parent_real = take(valid, safe_parent)
  match = has_parent & parent_real & (tokens == take(drawn, safe_parent))
  # Keep only the first matching child of each parent so the path is a chain even on bad input.
  same_parent = safe_parent[:, :, None] == safe_parent[:, None, :]
  earlier = idx[None, :, None] > idx[None, None, :]
  match &= ~jnp.any(match[:, None, :] & same_parent & earlier, axis=-1)

  ok = match.at[:, 0].set(valid[:, 0])
  jump = safe_parent.at[:, 0].set(0)  # the root points at itself, so jumps saturate there
  for _ in range(math.ceil(math.log2(q_len)) if q_len > 1 else 0):
    ok = ok & take(ok, jump)
    jump = take(jump, jump)
  on_path = ok & valid

  num_accepted = jnp.sum(on_path, axis=-1, dtype=jnp.int32)
  order = jnp.argsort(jnp.where(on_path, idx[None, :], q_len + idx[None, :]), axis=-1, stable=True)
  accepted_nodes = jnp.where(idx[None, :] < num_accepted[:, None], order, 0).astype(jnp.int32)
  last = take(accepted_nodes, jnp.maximum(num_accepted - 1, 0))
  bonus = jnp.where(num_accepted > 0, take(drawn, last), 0)

  # emitted[j]: the token of path node j + 1 (draft part), then the bonus at j = num_accepted - 1.
  next_nodes = jnp.concatenate([accepted_nodes[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
  j = idx[None, :]
  emitted = jnp.where(j < num_accepted[:, None] - 1, take(tokens, next_nodes), 0)
  emitted = jnp.where(j == num_accepted[:, None] - 1, bonus[:, None], emitted)
  num_emitted = num_accepted

  if stop_tokens is None:
    if stop_valid is not None:
      raise ValueError("accept: stop_valid given without stop_tokens")
    hit_stop = jnp.zeros((batch,), bool)
  else:
    if stop_tokens.ndim != 2 or stop_tokens.shape[0] != batch:
      raise ValueError(f"accept: stop_tokens must be [B={batch}, S], got {stop_tokens.shape}")
    if stop_valid is None:
      stop_valid = jnp.ones(stop_tokens.shape, bool)
    elif stop_valid.shape != stop_tokens.shape:
      raise ValueError(f"accept: stop_valid {stop_valid.shape} != stop_tokens {stop_tokens.shape}")
    is_stop = jnp.any((emitted[:, :, None] == stop_tokens[:, None, :]) & stop_valid[:, None, :], -1)
    is_stop &= j < num_emitted[:, None]
    hit_stop = jnp.any(is_stop, axis=-1)
    first_stop = jnp.argmax(is_stop, axis=-1).astype(jnp.int32)
    num_emitted = jnp.where(hit_stop, first_stop + 1, num_emitted)
    emitted = jnp.where(j < num_emitted[:, None], emitted, 0)

  return AcceptResult(
      accepted_nodes=accepted_nodes,
      num_accepted=num_accepted,
      bonus=bonus.astype(jnp.int32),
      emitted=emitted.astype(jnp.int32),
      num_emitted=num_emitted.astype(jnp.int32),
      hit_stop=hit_stop,
  )


def verify(logits, tree: Tree, sampling: SamplingParams, stop_tokens=None, stop_valid=None):
  """One verify step: ``draw_tokens`` at the tree's positions, then ``accept``.

  Args:
    logits: [B, Q, V] target logits at every node of ``tree``.
    tree: Tree with [B, Q] fields. Rows whose root is invalid (finished requests, empty batch
      slots) emit nothing and accept nothing.
    sampling: SamplingParams with [B] fields.
    stop_tokens, stop_valid: optional [B, S], see ``accept``.
  Returns:
    AcceptResult.
  """
  drawn = draw_tokens(logits, tree.positions, sampling)
  return accept(tree, drawn, stop_tokens, stop_valid)
