"""Top-k over a large vocabulary, exactly ``jax.lax.top_k``, in two small selections.

``lax.top_k`` over K2.6's 163840-token vocabulary is slow on the GPU: XLA runs a per-row selection
kernel for small k and a full segmented radix sort for larger k. Measured on an H100
(`benchmarks/results/logprobs_cost.md`), 320 rows cost 0.47 ms at k = 5 and 4.2 ms at k = 20, against
0.14 ms for reading them once. The drafter's proposals (k = the largest budget, B x 15 rows) and
the server's log-probabilities (k = ``--max-logprobs``) both select over that vocabulary every step.

Here the vocabulary is cut into chunks; a chunk's maximum is one read of the input, the k chunks
with the largest maxima hold the k largest values, and the final selection runs over those
k x chunk candidates only. Why that is exact, ties included: every value above the k-th largest v
lies in a chunk whose maximum exceeds v, and there are fewer than k such chunks; the remaining
places go to chunks whose maximum equals v, lowest chunk first, and each of them holds a value
equal to v with a lower index than any such value in a chunk left out. Keeping the chosen chunks in
ascending order then gives the final selection ``lax.top_k``'s own order: larger first, equal
values by lower index.

Not covered: NaN (its place in the order differs between a max reduction and a sort) and ties
between -0.0 and +0.0, neither of which finite logits or log-probabilities produce in a way that
matters here.
"""

import math

import jax
import jax.numpy as jnp


def chunk_for(vocab: int, k: int) -> int:
  """The chunk length that balances the two selections (chunks ~ k x chunk): a power of two near
  sqrt(vocab / k), at least 16 so that a chunk's maximum is a vector reduction. 0 when the
  two-stage form saves nothing (k x chunk would cover half the vocabulary or more)."""
  chunk = 1 << max(4, round(math.log2(max(vocab / max(k, 1), 1)) / 2))
  return chunk if 2 * k * chunk <= vocab else 0


def top_k(x, k: int, chunk: int | None = None):
  """``jax.lax.top_k(x, k)`` over the last axis: (values [..., k], ids int32[..., k]), largest first,
  equal values by lower index.

  Args:
    x: float[..., V].
    k: how many (static, 1 <= k <= V).
    chunk: chunk length (static); None picks ``chunk_for(V, k)``, 0 calls ``lax.top_k`` directly.
  """
  vocab = x.shape[-1]
  if not 1 <= k <= vocab:
    raise ValueError(f"k={k} must be in [1, {vocab}] (the last axis' length)")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"top_k takes floating inputs (padding is -inf), got {x.dtype}")
  if chunk is None:
    chunk = chunk_for(vocab, k)
  if chunk < 0:
    raise ValueError(f"chunk={chunk} must be >= 0")
  if chunk == 0 or k * chunk >= vocab:
    values, ids = jax.lax.top_k(x, k)
    return values, ids.astype(jnp.int32)
  lead = x.shape[:-1]
  pad = -vocab % chunk
  if pad:  # padding sorts after every real value, -inf included (higher index)
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-jnp.inf)
  chunks = x.reshape(*lead, (vocab + pad) // chunk, chunk)
  _, best = jax.lax.top_k(jnp.max(chunks, axis=-1), k)  # [..., k] chunk ids
  best = jnp.sort(best, axis=-1)
  candidates = jnp.take_along_axis(chunks, best[..., None], axis=-2)  # [..., k, chunk]
  values, pos = jax.lax.top_k(candidates.reshape(*lead, k * chunk), k)
  ids = jnp.take_along_axis(best, pos // chunk, axis=-1) * chunk + pos % chunk
  return values, ids.astype(jnp.int32)
