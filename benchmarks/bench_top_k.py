"""Top-k over Kimi K2.6's vocabulary (163840): ``jax.lax.top_k`` against ``models.topk.top_k``'s two-stage
form, side by side in one run (GPU time from CUPTI, median of 5), with the ids checked equal.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_top_k.py --out benchmarks/results     # GPU only

The shapes a K2.6 step selects at:
- *drafter*: ``dflash.propose``, top-k of each block position's log-softmax, batch x 15 rows, k = the
  engine's largest budget (32 for the server's default table, 64 at most);
- *logprobs*: ``logprobs.token_logprobs``, top-n of every tree node's logits, batch x nodes rows at
  the server's budget table (1:32, 4:16, 16:8, 64:4), n = 5 (``--max-logprobs`` default) and 20.

Writes ``bench_top_k.{json,md}``.
"""

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import results_io
from models import topk

VOCAB = 163840
DRAFT_POSITIONS = 15
SHAPES = ([("drafter", batch * DRAFT_POSITIONS, k) for k in (32, 64) for batch in (1, 4, 16, 64)]
          + [("logprobs", batch * nodes, n) for n in (5, 20) for batch, nodes in ((1, 33), (4, 17), (16, 9), (64, 5))])
CHUNKS = (None, 32, 128, 512)  # None: chunk_for's choice


def selector(use: str, k: int, chunk):
  """The jitted selection as the model runs it: over the log-softmax for the drafter, over the raw
  logits for logprobs; chunk 'lax' is lax.top_k itself."""
  pick = (lambda z: jax.lax.top_k(z, k)) if chunk == "lax" else (lambda z: topk.top_k(z, k, chunk))
  if use == "drafter":
    return jax.jit(lambda x: pick(jax.nn.log_softmax(x, axis=-1)))
  return jax.jit(pick)


def measure() -> list:
  from gpu_timing import per_call_device_us  # pylint: disable=import-outside-toplevel  # CUPTI: GPU only
  rng = np.random.default_rng(0)
  rows = []
  for use, n_rows, k in SHAPES:
    x = jnp.asarray(rng.normal(0, 4, (n_rows, VOCAB)), jnp.float32)
    _, lax_ids = selector(use, k, "lax")(x)
    for chunk in ("lax", *CHUNKS):
      fn = selector(use, k, chunk)
      us, kernels = per_call_device_us(fn, (x,), calls=1)
      same = bool(jnp.array_equal(fn(x)[1], lax_ids))
      label = chunk if chunk == "lax" else (topk.chunk_for(VOCAB, k) if chunk is None else chunk)
      rows.append({"use": use, "rows": n_rows, "k": k, "chunk": label, "default": chunk is None, "gpu_us": us,
                   "same_ids_as_lax": same, "kernels": dict(list(kernels.items())[:4])})
      print(json.dumps(rows[-1]), flush=True)
  return rows


def markdown(result: dict) -> str:
  lines = [f"# Top-k over K2.6's vocabulary ({VOCAB}): lax.top_k against the two-stage form "
           f"({result['device']}, jax {result['jax']})", "",
           "GPU us per call (CUPTI, median of 5), float32. *two-stage*: `models.topk.top_k` at its default chunk "
           "(`chunk_for`); *best chunk*: the fastest of the chunks tried. *ids equal*: every two-stage variant "
           "returned lax.top_k's ids.", "",
           "| use | rows | k | lax.top_k | two-stage (chunk) | speedup | best chunk | ids equal |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  cells = {}
  for r in result["rows"]:
    cells.setdefault((r["use"], r["rows"], r["k"]), []).append(r)
  for (use, n_rows, k), group in cells.items():
    lax_row = next(r for r in group if r["chunk"] == "lax")
    staged = [r for r in group if r["chunk"] != "lax"]
    default = next(r for r in staged if r["default"])
    best = min(staged, key=lambda r: r["gpu_us"])
    same = "yes" if all(r["same_ids_as_lax"] for r in staged) else "NO"
    lines.append(f"| {use} | {n_rows} | {k} | {lax_row['gpu_us']:.1f} | {default['gpu_us']:.1f} ({default['chunk']}) | "
                 f"{lax_row['gpu_us'] / default['gpu_us']:.1f}x | {best['gpu_us']:.1f} ({best['chunk']}) | {same} |")
  lines += ["", f"Command: `{result['command']}`"]
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    sys.exit("bench_top_k.py times with CUPTI: run it on a GPU")
  start = time.perf_counter()
  result = results_io.save_rows(measure(), out=args.out, name="bench_top_k", start=start, markdown=markdown,
                                merge=False, cell=lambda r: (r["use"], r["rows"], r["k"], str(r["chunk"])),
                                command="PYTHONPATH=.:benchmarks python3 benchmarks/bench_top_k.py " + " ".join(sys.argv[1:]),
                                vocab=VOCAB)
  print(markdown(result))


if __name__ == "__main__":
  main()
