"""How far a change of window shape alone moves the shipped target's bf16 logits, and why.

The bf16 near-tie rule (DESIGN §3: streams may differ only where the reference's top-2 margin is
below 1e-2) assumes that verify and greedy steps round alike. This measures, for the demo target in
bf16 on whatever backend runs it, teacher-forced logits of the same token sequences with prefill
chunks of 32, 16 and 1 (one token a step, as greedy decoding runs), and attributes the largest
changes: a position whose MoE routing (any layer's top-k set) differs between chunkings against
positions whose routing agrees. A routing flip turns a rounding difference of one ulp into a
different expert, the discrete amplifier behind the large changes.

    PYTHONPATH=. python3 benchmarks/bf16_noise.py --out benchmarks/results          # CPU or GPU

Writes ``bf16_noise_<backend>.{json,md}``.
"""

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from models import cache as cache_lib
from models import forward as fwd
from models import kimi, loading


MAX_CHUNK = 32


def teacher_forced(model, sequences, chunk: int, routing_log: list):
  """float32 logits [B, T, V] and the sorted top-k expert ids [moe_layers, B, T, K] per position."""
  routing_log.clear()
  length = len(sequences[0])
  # One pool length for every chunking, as a decoder has: only the window's shape changes.
  cache = cache_lib.init_cache(model.cfg, len(sequences), length + MAX_CHUNK)
  _, logits, _, _ = fwd.prefill(model, sequences, np.arange(len(sequences)), cache, chunk_size=chunk,
                                all_logits=True)
  logits = np.asarray(logits, np.float32)[:, :length]
  jax.effects_barrier()  # every routing callback has run
  layers = model.cfg.num_moe_layers
  chunks = -(-length // chunk)
  if len(routing_log) != layers * chunks:
    raise RuntimeError(f"expected {layers} x {chunks} routing records, got {len(routing_log)}")
  calls = [routing_log[i:i + layers] for i in range(0, len(routing_log), layers)]
  ids = [np.concatenate([c[layer].reshape(len(sequences), chunk, -1) for c in calls], axis=1)[:, :length]
         for layer in range(layers)]
  return logits, np.sort(np.stack(ids), axis=-1)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--length", type=int, default=96, help="tokens of each held-out prompt used")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()

  routing_log = []
  route = kimi.route

  def logged_route(logits, bias, valid, cfg):
    ids, weights = route(logits, bias, valid, cfg)
    jax.debug.callback(lambda i: routing_log.append(np.asarray(i)), ids, ordered=True)
    return ids, weights

  path = loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json"
  sequences = [p["tokens"][:args.length] for p in json.loads(path.read_text())["prompts"][:args.prompts]]
  if min(map(len, sequences)) < args.length:
    raise SystemExit(f"--length {args.length} exceeds a held-out prompt ({min(map(len, sequences))} tokens)")
  start = time.time()
  kimi.route = logged_route  # observe only: the same ids and weights flow on
  try:
    target = loading.load_kimi("kimi-demo", dtype="bfloat16", param_dtype="bfloat16")
    runs = {chunk: teacher_forced(target, sequences, chunk, routing_log) for chunk in (MAX_CHUNK, 16, 1)}
    with jax.default_matmul_precision("highest"):
      exact = loading.load_kimi("kimi-demo", dtype="float32", param_dtype="bfloat16")
      runs["float32"] = teacher_forced(exact, sequences, 32, routing_log)
  finally:
    kimi.route = route

  base_logits, base_ids = runs[32]
  # What the near-tie rule judges: the gap between the reference's top two tokens.
  top_two = np.argsort(base_logits, axis=-1)[..., -2:]
  gap = lambda logits: np.diff(np.take_along_axis(logits, top_two, axis=-1), axis=-1)[..., 0]
  rows = []
  for other in (16, 1, "float32"):
    logits, ids = runs[other]
    change = np.abs(logits - base_logits).max(-1)  # [B, T]: largest change over the vocabulary
    rerouted = (ids != base_ids).any(-1).any(0)  # [B, T]: some layer's expert set differs
    # A reroute reaches every later position of its sequence through the KV cache: "clean" are
    # the positions before their sequence's first reroute.
    clean = np.cumsum(rerouted, axis=1) == 0
    kept = change[clean]
    gap_change = np.abs(gap(logits) - gap(base_logits))
    rows.append(dict(
        compared=f"chunk {other} vs chunk 32" if other != "float32" else "float32 vs bf16 (chunk 32)",
        positions=int(change.size), rerouted_positions=int(rerouted.sum()),
        rerouted_layer_positions=int((ids != base_ids).any(-1).sum()),
        mean_max_change=float(change.mean()), max_change=float(change.max()),
        max_change_rerouted=float(change[rerouted].max()) if rerouted.any() else None,
        clean_positions=int(clean.sum()),
        mean_max_change_clean=float(kept.mean()) if kept.size else None,
        max_change_clean=float(kept.max()) if kept.size else None,
        clean_over_1e2=int((kept > 1e-2).sum()),
        mean_gap_change_clean=float(gap_change[clean].mean()) if kept.size else None,
        max_gap_change_clean=float(gap_change[clean].max()) if kept.size else None,
        clean_gap_over_1e2=int((gap_change[clean] > 1e-2).sum()),
        argmax_flips=int((logits.argmax(-1) != base_logits.argmax(-1)).sum()),
        positions_over_1e2=int((change > 1e-2).sum())))
  top2 = np.sort(base_logits, -1)[..., -2:]
  margins = top2[..., 1] - top2[..., 0]
  result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                jax=jax.__version__, prompts=args.prompts, length=args.length,
                moe_layers=target.cfg.num_moe_layers, rows=rows,
                margins_below=dict((str(t), int((margins < t).sum())) for t in (1e-2, 0.05, 0.1, 0.5)),
                seconds=round(time.time() - start, 1))
  args.out.mkdir(parents=True, exist_ok=True)
  name = f"bf16_noise_{result['backend']}"
  (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
  fmt = lambda x: "-" if x is None else f"{x:.4f}"
  lines = [f"# bf16 logit changes from the window shape alone ({result['backend']}: {result['device']}, "
           f"jax {result['jax']})", "",
           f"Demo target, {args.prompts} held-out prompts x {args.length} tokens teacher-forced "
           f"({result['moe_layers']} MoE layers). Per position: the largest |logit change| over the "
           "vocabulary ('change'), and the change of the gap between the chunk-32 run's top two tokens "
           "('gap', what the near-tie rule judges); 'rerouted': some MoE layer picked another expert "
           "set there; 'clean': positions "
           "before their sequence's first reroute (a reroute reaches every later position through "
           "the KV cache).", "",
           "| compared | positions | rerouted | mean change | max change | max at a reroute | "
           "clean positions | mean clean | max clean | clean > 1e-2 | all > 1e-2 | "
           "gap: mean clean | gap: max clean | gap: clean > 1e-2 | argmax flips |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    lines.append(f"| {r['compared']} | {r['positions']} | {r['rerouted_positions']} | "
                 f"{fmt(r['mean_max_change'])} | {fmt(r['max_change'])} | {fmt(r['max_change_rerouted'])} | "
                 f"{r['clean_positions']} | {fmt(r['mean_max_change_clean'])} | {fmt(r['max_change_clean'])} | "
                 f"{r['clean_over_1e2']} | {r['positions_over_1e2']} | "
                 f"{fmt(r['mean_gap_change_clean'])} | {fmt(r['max_gap_change_clean'])} | "
                 f"{r['clean_gap_over_1e2']} | {r['argmax_flips']} |")
  lines += ["", "Top-2 margins of the chunk-32 bf16 logits below 0.01 / 0.05 / 0.1 / 0.5: "
            + " / ".join(str(v) for v in result["margins_below"].values()) + f" of {rows[0]['positions']}.",
            "", f"Command: `PYTHONPATH=. python3 benchmarks/bf16_noise.py --prompts {args.prompts} "
            f"--length {args.length} --out {args.out}` ({result['seconds']} s)"]
  (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
