"""The ``Drafter`` protocol, and two drafters for testing the engine without a trained model.

A drafter keeps a per-slot context of committed tokens (with the target's features of them) and
proposes, for the L positions after a root token, each position's top-k candidate tokens with
log-probabilities. Its methods are called inside the engine's compiled step, so a drafter object
is static configuration (hashable, no arrays); its parameters and its context cache are pytrees
passed alongside.
"""

import dataclasses
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class Drafter(Protocol):
  """What the engine needs of a drafter.

  Attributes:
    num_positions: L, the depths one proposal covers (DFlash: block_size - 1).
    feature_layers: target decoder-layer ids whose outputs ``extend`` receives (0-based: id l is
      the output of decoder layer l).
  """

  num_positions: int
  feature_layers: tuple[int, ...]

  def init_state(self, num_slots: int, max_len: int) -> Any:
    """The context cache for ``num_slots`` slots plus the scratch slot ``num_slots``.

    A drafter may also define ``check_params(params)``, raising ValueError for parameters it cannot
    use; the engine calls it when it is built."""

  def reset(self, params, state, slot, prompt) -> Any:
    """Empties ``slot`` for a new request. Called eagerly at admission, before the prompt's
    ``extend`` calls, with ``slot`` a numpy int32[1] and ``prompt`` the request's numpy token ids;
    it must not compile on repeated calls (the engine promises no compilation after warm-up).

    A drafter whose reset needs neither the parameters nor the prompt may instead define
    ``reset_slot(state, slot) -> state``, a pure jax function; the engine then compiles it ahead of
    time and calls it in place of ``reset``, so that admission never waits for the steps in flight
    (a ``reset`` that reads the state back to the host waits for all of them)."""

  def extend(self, params, state, slots, tokens, positions, features, num_new) -> Any:
    """Appends committed tokens to each slot's context.

    Args:
      slots: int32[B]; tokens, positions: int32[B, Q]; features: [B, Q, K, H] target features of
      those tokens; num_new: int32[B], real rows (the rest is padding and must be ignored).
    Called for every committed token, at every budget (0 included), in position order.
    """

  def propose(self, params, state, slots, root_tokens, start, top_k: int):
    """Top-k candidates of the L positions after each root.

    Args:
      root_tokens: int32[B] tokens at positions ``start`` (not yet in the context).
    Returns:
      (ids int32[B, L, top_k], logprobs float32[B, L, top_k]); ids distinct per position, sorted
      by logprob descending. Position d (0-based) predicts the token at ``start + d + 1``.
    """


def _row_keys(seed, start, root_tokens):
  """One key per request from its own (position, root): drafts do not depend on the batch."""
  base = jax.random.key(seed)
  return jax.vmap(lambda s, r: jax.random.fold_in(jax.random.fold_in(base, s), r))(start, root_tokens)


def _distinct_candidates(keys, positions, vocab_size, top_k):
  """Random distinct token ids [B, L, k] (a random permutation's first k per position)."""
  noise = jax.vmap(lambda k: jax.random.uniform(k, (positions, vocab_size)))(keys)
  return jax.lax.top_k(noise, top_k)[1].astype(jnp.int32)


def _descending_logprobs(keys, shape, spread):
  """Sorted-descending log-probabilities with random gaps (strictly decreasing)."""
  gaps = 0.05 + spread * jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(keys)
  scores = -jnp.cumsum(gaps, axis=-1)
  return jax.nn.log_softmax(scores, axis=-1)


def _split_rows(keys, num):
  """[B] keys -> num arrays of [B] keys."""
  split = jax.vmap(lambda k: jax.random.split(k, num))(keys)  # [B, num]
  return [split[:, i] for i in range(num)]


@dataclasses.dataclass(frozen=True)
class RandomDrafter:
  """Random distinct candidates with random log-probabilities: almost never accepted."""

  vocab_size: int
  num_positions: int = 15
  feature_layers: tuple[int, ...] = ()
  seed: int = 0

  def init_state(self, num_slots, max_len):
    return jnp.zeros((), jnp.int32)

  def reset(self, params, state, slot, prompt):
    return state

  def extend(self, params, state, slots, tokens, positions, features, num_new):
    return state

  def propose(self, params, state, slots, root_tokens, start, top_k):
    k_ids, k_lp = _split_rows(_row_keys(self.seed, start, root_tokens), 2)
    ids = _distinct_candidates(k_ids, self.num_positions, self.vocab_size, top_k)
    return ids, _descending_logprobs(k_lp, ids.shape, 1.0)


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
  """Proposes the target's own continuation, which it was told in advance.

  ``continuations`` maps a prompt (tuple of ids) to the tokens that follow it (for example the
  target's greedy output). With ``noise = 0`` the true token is rank 0 at every position, so a
  chain is accepted whole; with ``noise = p`` each position's true token is moved to a random rank
  in ``1..noise_ranks`` with probability p, which only a tree with siblings can recover. Positions
  past the known continuation get random candidates.
  """

  continuations: Any  # tuple of (prompt, continuation) pairs (hashable)
  vocab_size: int
  max_len: int
  num_positions: int = 15
  feature_layers: tuple[int, ...] = ()
  noise: float = 0.0
  noise_ranks: int = 3
  seed: int = 0

  @classmethod
  def make(cls, continuations: dict, **kwargs) -> "OracleDrafter":
    pairs = tuple((tuple(int(t) for t in p), tuple(int(t) for t in c)) for p, c in continuations.items())
    return cls(continuations=pairs, **kwargs)

  def _known(self, prompt) -> np.ndarray:
    """Host: the row of the oracle table for a prompt: prompt + continuation, -1 elsewhere."""
    row = np.full((self.max_len,), -1, np.int32)
    prompt = tuple(int(t) for t in prompt)
    for p, c in self.continuations:
      if p == prompt:
        seq = (p + c)[:self.max_len]
        row[:len(seq)] = seq
        return row
    row[:len(prompt)] = prompt
    return row

  def init_state(self, num_slots, max_len):
    if max_len != self.max_len:
      raise ValueError(f"OracleDrafter built for max_len {self.max_len}, engine uses {max_len}")
    return jnp.full((num_slots + 1, max_len), -1, jnp.int32)

  def reset(self, params, state, slot, prompt):
    # On the host: the row is looked up by prompt, and a host round trip of this test-only table
    # keeps admission free of device ops that would compile.
    table = np.array(state)
    table[np.asarray(slot)] = self._known(np.asarray(prompt))
    return jax.device_put(table)

  def extend(self, params, state, slots, tokens, positions, features, num_new):
    return state

  def propose(self, params, state, slots, root_tokens, start, top_k):
    positions = self.num_positions
    k_ids, k_noise, k_rank = _split_rows(_row_keys(self.seed, start, root_tokens), 3)
    cols = start[:, None] + 1 + jnp.arange(positions)[None, :]  # [B, L]
    truth = jnp.take_along_axis(state[slots], jnp.clip(cols, 0, self.max_len - 1), axis=1)
    known = (truth >= 0) & (cols < self.max_len)
    ids = _distinct_candidates(k_ids, positions, self.vocab_size, top_k)
    moved = jax.vmap(lambda k: jax.random.uniform(k, (positions,)))(k_noise) < self.noise
    rank = jnp.where(moved, jax.vmap(lambda k: jax.random.randint(k, (positions,), 1, self.noise_ranks + 1))(k_rank), 0)
    rank = jnp.minimum(rank, top_k - 1)
    # Remove the true token where the random candidates already hold it, then insert it at `rank`.
    holds = ids == truth[..., None]
    rest = jnp.where(holds.any(-1, keepdims=True),
                     jnp.where(jnp.cumsum(holds, -1) > 0, jnp.roll(ids, -1, axis=-1), ids), ids)
    slot_idx = jnp.arange(top_k)[None, None, :]
    shifted = jnp.where(slot_idx > rank[..., None], jnp.roll(rest, 1, axis=-1), rest)
    placed = jnp.where(slot_idx == rank[..., None], truth[..., None], shifted)
    ids = jnp.where(known[..., None], placed, ids)
    return ids.astype(jnp.int32), jnp.broadcast_to(self._calibrated_logprobs(top_k), ids.shape)

  def _calibrated_logprobs(self, top_k):
    """The oracle's true odds: rank 0 with 1 - noise, ranks 1..noise_ranks share the noise.

    Calibration is what lets a tree policy spend its budget where the true token can be.
    A small per-rank slope keeps the list strictly descending.
    """
    rank = jnp.arange(top_k, dtype=jnp.float32)
    floor = 1e-6
    prob = jnp.where(rank == 0, 1.0 - self.noise,
                     jnp.where(rank <= self.noise_ranks, self.noise / self.noise_ranks, 0.0))
    return jnp.log(prob + floor) - 1e-3 * rank


def greedy_continuations(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> dict:
  """{prompt: output} for ``OracleDrafter.make``."""
  return {tuple(int(t) for t in p): tuple(int(t) for t in o) for p, o in zip(prompts, outputs)}
