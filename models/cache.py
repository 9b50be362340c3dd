"""The latent KV cache: a pool of request slots, and its host-side bookkeeping.

Device side (``KVCache``, a pytree): per layer, ``c_kv`` (kv_lora_rank) and ``k_pe`` (rope dim)
for ``[num_slots + 1, max_len]`` tokens, and the committed length of every slot. The extra last
slot is scratch: batch rows that carry no request point at it, so they never touch a real slot.

Host side (``SlotPool``): which slots are in use and a mirror of their committed lengths, so
that ``models.forward.verify(..., pool=...)`` refuses a window that does not fit before dispatch,
without waiting on the device. (The engine checks once, at admission, that prompt + max_new_tokens
+ one window fit, and updates the mirror as it reads each step's results.)
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


class SlotPooled:
  """Shape facts shared by slot-pooled caches: ``lengths`` has one entry per slot plus the
  scratch slot, and the first array field is ``[layers, slots + 1, max_len, ...]``."""

  @property
  def num_slots(self) -> int:
    """Usable slots (the scratch slot excluded)."""
    return self.lengths.shape[0] - 1

  @property
  def scratch_slot(self) -> int:
    return self.lengths.shape[0] - 1

  @property
  def max_len(self) -> int:
    return getattr(self, dataclasses.fields(self)[0].name).shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache(SlotPooled):
  """Latent cache pool.

  Attributes:
    c_kv: [num_layers, num_slots + 1, max_len, kv_lora_rank], after kv_a_layernorm.
    k_pe: [num_layers, num_slots + 1, max_len, qk_rope_head_dim], roped.
    lengths: int32[num_slots + 1], committed tokens per slot (the scratch slot stays 0).
  """

  c_kv: jax.Array
  k_pe: jax.Array
  lengths: jax.Array


def init_cache(config, num_slots: int, max_len: int, dtype=None) -> KVCache:
  """An empty pool for ``num_slots`` requests of up to ``max_len`` tokens (window included)."""
  if num_slots <= 0 or max_len <= 0:
    raise ValueError(f"init_cache: num_slots={num_slots} and max_len={max_len} must be positive")
  dtype = jnp.dtype(dtype or config.dtype)
  layers = config.num_hidden_layers
  return KVCache(
      c_kv=jnp.zeros((layers, num_slots + 1, max_len, config.kv_lora_rank), dtype),
      k_pe=jnp.zeros((layers, num_slots + 1, max_len, config.qk_rope_head_dim), dtype),
      lengths=jnp.zeros((num_slots + 1,), jnp.int32),
  )


def write_window(pool, slots, prefix_len, values):
  """Writes a window's rows after each request's prefix.

  Args:
    pool: [S + 1, T, D] one layer's pool; slots, prefix_len: int32[B].
    values: [B, Q, D] rows for columns ``prefix_len .. prefix_len + Q - 1``.
  Returns:
    The updated pool. Committed columns (< prefix_len) are never written.
  """
  q_len = values.shape[1]
  cols = prefix_len[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]  # [B, Q]
  rows = jnp.broadcast_to(slots[:, None], cols.shape)
  return pool.at[rows, cols].set(values.astype(pool.dtype), mode='drop')


def commit(cache: KVCache, slots, accepted_nodes, num_accepted) -> KVCache:
  """Moves accepted window rows to the end of the prefix and advances the lengths.

  Args:
    slots: int32[B].
    accepted_nodes: int32[B, Q], window row of the i-th accepted node (node 0 first); entries at
      i >= num_accepted are ignored.
    num_accepted: int32[B], nodes to commit per request (0 for rows without a request).
  Returns:
    The cache with ``[start, start + num_accepted)`` holding the accepted rows, in path order.
  """
  q_len = accepted_nodes.shape[1]
  start = cache.lengths[slots]  # [B]
  src = start[:, None] + accepted_nodes  # [B, Q]
  keep = jnp.arange(q_len)[None, :] < num_accepted[:, None]
  # Writes past num_accepted go out of bounds and are dropped.
  dst = jnp.where(keep, start[:, None] + jnp.arange(q_len)[None, :], cache.max_len)
  rows = jnp.broadcast_to(slots[:, None], src.shape)

  def move(pool):  # [L, S + 1, T, D]
    gathered = pool[:, rows, src]  # [L, B, Q, D]: read everything before writing
    return pool.at[:, rows, dst].set(gathered, mode='drop')

  lengths = cache.lengths.at[slots].add(num_accepted)
  return KVCache(c_kv=move(cache.c_kv), k_pe=move(cache.k_pe), lengths=lengths)


def advance(cache: KVCache, slots, num_tokens) -> KVCache:
  """Commits a window whose rows are already in order (a prefill chunk): lengths only."""
  return dataclasses.replace(cache, lengths=cache.lengths.at[slots].add(num_tokens))


def reset_slots(cache: KVCache, slots) -> KVCache:
  """Marks slots empty (their rows become dead; nothing else needs clearing)."""
  return dataclasses.replace(cache, lengths=cache.lengths.at[slots].set(0))


class CacheError(ValueError):
  """A request does not fit the cache, or names a slot it does not own."""


class SlotPool:
  """Host bookkeeping for a ``KVCache``: free slots and an exact mirror of committed lengths.

  Every change the device sees goes through here first (``allocate``, ``release``,
  ``check_window``, ``record_commit``), so nothing needs to be read back to validate a call.
  """

  def __init__(self, num_slots: int, max_len: int):
    self.num_slots = num_slots
    self.max_len = max_len
    self.lengths = np.zeros((num_slots,), np.int64)
    self._free = list(range(num_slots - 1, -1, -1))
    self._used: set[int] = set()

  @property
  def scratch_slot(self) -> int:
    return self.num_slots

  @property
  def free_slots(self) -> int:
    return len(self._free)

  def allocate(self) -> int:
    if not self._free:
      raise CacheError(f"no free cache slot: all {self.num_slots} are in use")
    slot = self._free.pop()
    self._used.add(slot)
    self.lengths[slot] = 0
    return slot

  def release(self, slot: int) -> None:
    self._check_owned([slot])
    self._used.remove(slot)
    self._free.append(slot)
    self.lengths[slot] = 0

  def _check_owned(self, slots) -> None:
    for slot in slots:
      slot = int(slot)
      if not 0 <= slot < self.num_slots:
        raise CacheError(f"unknown slot {slot}: the pool has slots 0..{self.num_slots - 1}")
      if slot not in self._used:
        raise CacheError(f"slot {slot} is not allocated")

  def check_window(self, slots, q_len: int) -> np.ndarray:
    """Refuses a window of ``q_len`` rows that would overrun any slot; returns the starts."""
    slots = np.asarray(slots)
    self._check_owned(slots)
    if len(set(slots.tolist())) != len(slots):
      raise CacheError(f"slots {slots.tolist()} repeat within one batch")
    starts = self.lengths[slots]
    over = starts + q_len > self.max_len
    if over.any():
      i = int(np.argmax(over))
      raise CacheError(
          f"window of {q_len} rows does not fit slot {int(slots[i])}: {int(starts[i])} committed "
          f"+ {q_len} > max_len {self.max_len}")
    return starts

  def record_commit(self, slots, num_committed) -> None:
    slots = np.asarray(slots, np.int64)  # an empty list is float64 to numpy
    self.lengths[slots] += np.asarray(num_committed, self.lengths.dtype)
