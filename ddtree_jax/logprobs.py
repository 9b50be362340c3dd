"""Log-probabilities of emitted tokens under the target (what the OpenAI API calls ``logprobs``).

A token's log-probability is taken from the target's raw distribution at the node it was drawn
at: ``log_softmax`` of the logits, before temperature, top-k and top-p (vLLM's default,
"raw logprobs"). So a greedy token's logprob is the largest at its position, and a sampled
token's is what the model gave it, whatever the request's sampling settings. Speculation does not
change them: an emitted token is drawn at the node whose prefix is exactly the token's real
prefix, and the logits there are what plain decoding computes for that prefix (given the same
logits: in bf16 the verify window's shape moves them, the README's bf16 open problem).

Shapes: ``B`` batch rows, ``N`` nodes with logits, ``Q`` emitted tokens, ``V`` vocabulary, ``n``
alternatives a token.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models import topk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """Log-probabilities of a batch's emitted tokens (a pytree).

  Attributes:
    token: float32[B, Q], each emitted token's log-probability.
    top_ids: int32[B, Q, n], the n most likely tokens at the token's node, most likely first
      (ties: the lower id first).
    top: float32[B, Q, n], their log-probabilities.
  """

  token: jax.Array
  top_ids: jax.Array
  top: jax.Array


def token_logprobs(logits, nodes, tokens, top_n: int) -> TokenLogprobs:
  """Each token's log-probability at its node, and the node's ``top_n`` most likely tokens.

  Args:
    logits: float[B, N, V], the target's logits at every node.
    nodes: int32[B, Q], the node each token was drawn at (indices into N).
    tokens: int32[B, Q], the tokens.
    top_n: alternatives a token (static; 0 computes none).
  """
  if top_n < 0:
    raise ValueError(f"top_n={top_n} must be >= 0")
  z = logits.astype(jnp.float32)
  batch, q_len = nodes.shape
  node_norm = jnp.take_along_axis(jax.scipy.special.logsumexp(z, axis=-1), nodes, axis=1)  # [B, Q]
  token = z[jnp.arange(batch)[:, None], nodes, tokens] - node_norm
  if top_n == 0:
    return TokenLogprobs(token=token, top_ids=jnp.zeros((batch, q_len, 0), jnp.int32),
                         top=jnp.zeros((batch, q_len, 0), jnp.float32))
  # top-k over every node, then the emitting nodes' rows: gathering [B, Q, V] first would copy the
  # logits (top_k reads a materialised array), and a tree has no more nodes than Q anyway.
  top, top_ids = topk.top_k(z, top_n)  # [B, N, n]
  top = jnp.take_along_axis(top, nodes[:, :, None], axis=1)
  top_ids = jnp.take_along_axis(top_ids, nodes[:, :, None], axis=1)
  return TokenLogprobs(token=token, top_ids=top_ids.astype(jnp.int32), top=top - node_norm[:, :, None])


class TokenLogprob(NamedTuple):
  """One emitted token's log-probability, on the host.

  ``top``: ((token_id, logprob), ...) of the node's most likely tokens, most likely first (empty
  when the engine computes no alternatives).
  """

  logprob: float
  top: tuple


def host_entries(host: TokenLogprobs, row: int, count: int) -> list:
  """The TokenLogprob of the first ``count`` tokens of ``row`` (``host``: a TokenLogprobs of numpy
  arrays). Per row and only the tokens read: a step's whole arrays at batch 64 and budget 64 would
  be thousands of entries, nearly all unused."""
  ids, top = host.top_ids[row, :count].tolist(), host.top[row, :count].tolist()
  return [TokenLogprob(lp, tuple(zip(i, t))) for lp, i, t in zip(host.token[row, :count].tolist(), ids, top)]
