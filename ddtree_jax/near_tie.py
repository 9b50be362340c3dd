"""Greedy reference decoding and the near-tie rule (DESIGN §3) for token-equality tests.

Two token streams may differ only where the reference's top-2 logit margin at the first
divergent position is below the dtype's tolerance (1e-4 in float32, 1e-2 in bf16); such ties are
counted and reported, any other divergence fails.
"""

import jax
import jax.numpy as jnp
import numpy as np

from models import cache as cache_lib
from models import forward as fwd

TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
PREFILL_CHUNK = 32  # greedy_reference prefills in whole chunks of this many tokens
_decode = jax.jit(fwd.decode_step)


def greedy_reference(model, prompts, max_new_tokens: int, max_len: int):
  """Plain greedy decoding of the target alone (prefill, then one token per step).

  Independent of the engine: no trees, no drafter, no verify walk.
  Returns:
    (tokens: list of lists, margins: list of float arrays) where margins[i][t] is the top-2 logit
    margin of the logits that produced tokens[i][t].
  """
  batch = len(prompts)
  cache = cache_lib.init_cache(model.cfg, batch, max_len)
  slots = jnp.arange(batch, dtype=jnp.int32)
  tokens, margins = [], []
  with fwd.matmul_precision(model.cfg):  # as the engine compiles its steps
    last, _, _, cache = fwd.prefill(model, prompts, np.arange(batch), cache, chunk_size=PREFILL_CHUNK)
    logits = np.asarray(last)
    for _ in range(max_new_tokens):
      top2 = np.sort(logits, axis=-1)[:, -2:]
      margins.append(top2[:, 1] - top2[:, 0])
      nxt = np.argmax(logits, axis=-1).astype(np.int32)
      tokens.append(nxt)
      out, _, cache = _decode(model, jnp.asarray(nxt), slots, cache)
      logits = np.asarray(out)
  tokens = np.stack(tokens, axis=1)
  margins = np.stack(margins, axis=1)
  return [t.tolist() for t in tokens], [m for m in margins]


def classify(got, ref_tokens, ref_margins, dtype: str = "float32"):
  """Per stream: None (equal), ("tie", index, margin) or ("divergence", index, margin)."""
  tol = TOLERANCE[dtype]
  verdicts = []
  for g, r, margins in zip(got, ref_tokens, ref_margins):
    n = min(len(g), len(r))
    diverge = next((t for t in range(n) if g[t] != r[t]), None)
    if diverge is None:
      verdicts.append(None if len(g) == len(r) else ("divergence", n, float("inf")))
      continue
    margin = float(margins[diverge])
    verdicts.append(("tie" if margin < tol else "divergence", diverge, margin))
  return verdicts


def check_near_ties(got, ref_tokens, ref_margins, dtype: str = "float32", context: str = "") -> int:
  """Asserts each stream equals its reference up to near ties; returns the number of ties."""
  ties = 0
  for i, verdict in enumerate(classify(got, ref_tokens, ref_margins, dtype)):
    if verdict is None:
      continue
    kind, index, margin = verdict
    assert kind == "tie", (
        f"{context} stream {i} diverges at token {index} ({got[i][index] if index < len(got[i]) else 'end'} vs "
        f"reference {ref_tokens[i][index] if index < len(ref_tokens[i]) else 'end'}) where the reference's top-2 "
        f"margin is {margin:.3g} >= {TOLERANCE[dtype]} ({dtype}): not a near tie")
    ties += 1
  return ties
