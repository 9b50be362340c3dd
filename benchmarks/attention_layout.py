"""The plain-jnp attention's two product layouts side by side: bf16 logit noise and greedy identity.

    PYTHONPATH=. python3 benchmarks/attention_layout.py --out benchmarks/results     # CPU or GPU

Until 2026-12-07 ``pallas_kernels/reference.py`` laid its MLA attention scores out [B, N, Q, T];
on XLA:CPU that made a row's value depend on the window's row count (``docs/bf16_near_ties.md``).
This runs the previous layout ("transposed", defined here) and the current one ("dot order", the
module's) as the demo target's attention, one after the other in one process (the drafter has an
attention of its own, unchanged):

* teacher-forced logits of 8 held-out prompts x 96 tokens with prefill chunks of 16 and 1 against
  chunks of 32 (one pool length for all): positions whose logits moved, and the mean of the largest
  change per position;
* the engine's greedy streams (16 prompts x 48 new tokens; budgets 0, 4 and 16 at batch 1 and 4)
  against ``near_tie.greedy_reference`` (all 16 prompts decoded at once): streams identical, and
  where one differs, its first differing token and the reference's top-2 margin there.

Writes ``attention_layout_<backend>.{json,md}``.
"""

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import engine
from ddtree_jax.near_tie import classify, greedy_reference
from models import cache as cache_lib
from models import dflash, loading
from models import forward as fwd
from pallas_kernels import reference


def transposed_mla(q_latent, q_rope, c_kv, k_pe, slots, prefix_len, visibility, valid, *, scale):
  """``reference.mla_tree_attention`` as it was: scores [B, N, Q, T], products transposed."""
  kv, kr = c_kv[slots].astype(jnp.float32), k_pe[slots].astype(jnp.float32)
  scores = (jnp.einsum('bqnr,btr->bnqt', q_latent.astype(jnp.float32), kv) +
            jnp.einsum('bqnp,btp->bnqt', q_rope.astype(jnp.float32), kr)) * scale
  mask = reference.cache_mask(prefix_len, visibility, valid, c_kv.shape[1])[:, None]
  probs = reference._masked_softmax(scores, mask)  # pylint: disable=protected-access
  return jnp.einsum('bnqt,btr->bqnr', probs, kv)


LAYOUTS = {"transposed": transposed_mla, "dot order": reference.mla_tree_attention}


def chunk_noise(target, sequences, max_chunk: int = 32):
  """{"chunk C": (positions moved, mean largest |change|)} against chunks of ``max_chunk``."""
  def logits(chunk):
    cache = cache_lib.init_cache(target.cfg, len(sequences), len(sequences[0]) + max_chunk)
    _, out, _, _ = fwd.prefill(target, sequences, np.arange(len(sequences)), cache, chunk_size=chunk,
                               all_logits=True)
    return np.asarray(out, np.float32)[:, :len(sequences[0])]
  base = logits(max_chunk)
  result = {}
  for chunk in (16, 1):
    change = np.abs(logits(chunk) - base).max(-1)
    result[f"chunk {chunk}"] = (int((change > 0).sum()), float(change.mean()))
  return result


BUDGETS = (0, 4, 16)


def greedy_identity(target, draft, prompts, new_tokens: int):
  """[(budget, batch, identical streams, [(stream, token, margin), ...])] against greedy decoding."""
  max_len = max(map(len, prompts)) + new_tokens + max(BUDGETS) + 1
  ref_tokens, margins = greedy_reference(target, prompts, new_tokens, max_len)
  decoder = engine.SpeculativeDecoder(target, dflash.DFlashDrafter(draft.cfg), dflash.DFlashDrafter.params(draft, target),
                                      policy="ddtree", budgets=BUDGETS, batch_buckets=(1, 4), max_len=max_len,
                                      show_progress=False)
  rows = []
  for budget in BUDGETS:
    for batch in (1, 4):
      tokens = []
      for i in range(0, len(prompts), batch):
        tokens += decoder.generate(prompts[i:i + batch], new_tokens, budget=budget, stop_token_ids=[]).tokens
      verdicts = classify(tokens, ref_tokens, margins, dtype="bfloat16")
      rows.append((budget, batch, sum(v is None for v in verdicts),
                   [(i, v[1], round(v[2], 4)) for i, v in enumerate(verdicts) if v]))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()
  start = time.time()
  target = loading.load_kimi("kimi-demo", dtype="bfloat16")
  draft = loading.load_dflash("kimi-demo-dflash", dtype="bfloat16")
  held = [p["tokens"] for p in
          json.loads((loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json").read_text())["prompts"]]
  current = reference.mla_tree_attention
  results = {}
  try:
    for name, attention in LAYOUTS.items():
      reference.mla_tree_attention = attention  # the model looks it up per call
      jax.clear_caches()
      results[name] = dict(noise=chunk_noise(target, [p[:96] for p in held[:8]]),
                           greedy=greedy_identity(target, draft, [p[:64] for p in held[:16]], 48))
  finally:
    reference.mla_tree_attention = current
  backend = jax.default_backend()
  out = dict(backend=backend, device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             layouts=results, seconds=round(time.time() - start, 1))
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / f"attention_layout_{backend}.json").write_text(json.dumps(out, indent=1))
  lines = [f"# The plain-jnp attention's product layouts, bf16 demo pair ({backend}: {out['device']}, jax {out['jax']})",
           "", "Teacher-forced logits against prefill chunks of 32 (8 prompts x 96 tokens, 768 positions, one pool "
           "length):", "", "| layout | chunk 16: positions moved | mean change | chunk 1: positions moved | mean change |",
           "| --- | --- | --- | --- | --- |"]
  for name, r in results.items():
    (m16, c16), (m1, c1) = r["noise"]["chunk 16"], r["noise"]["chunk 1"]
    lines.append(f"| {name} | {m16} | {c16:.4f} | {m1} | {c1:.4f} |")
  lines += ["", "Greedy streams of the engine (ddtree) against greedy decoding of the target alone (16 prompts x 48 "
            "tokens, the reference decoding all 16 at once); differing streams as (stream, first differing token, "
            "reference top-2 margin there):", "", "| layout | budget | batch | identical | differing |",
            "| --- | --- | --- | --- | --- |"]
  for name, r in results.items():
    for budget, batch, same, differing in r["greedy"]:
      lines.append(f"| {name} | {budget} | {batch} | {same}/16 | {differing or '-'} |")
  lines += ["", f"Command: `PYTHONPATH=. python3 benchmarks/attention_layout.py --out {args.out}` ({out['seconds']} s)"]
  (args.out / f"attention_layout_{backend}.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
