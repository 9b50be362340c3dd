"""Command-line generation from a model preset (the main job until the server lands).

    python -m ddtree_jax.generate --prompt "def fib(n):" --max-new-tokens 48 --policy ddtree --budget 8

Until trained weights ship, the model is a randomly initialised preset, its vocabulary read as
bytes (the tiny preset has 256 tokens), so the text is noise; what the command shows is the
machinery: speculative output is checked against plain greedy decoding and the acceptance length
is reported. ``--drafter oracle`` first decodes greedily and then drafts that very continuation
(every draft is accepted); ``--drafter random`` drafts noise (almost nothing is accepted).
"""

import argparse
import sys
import time

import numpy as np

from ddtree_jax import drafters, engine, policies
from models import kimi
from models.config import KimiConfig

PRESETS = {"tiny": KimiConfig.tiny}


def _encode(text: str, vocab_size: int) -> list[int]:
  data = list(text.encode("utf-8"))
  if max(data, default=0) >= vocab_size:
    raise SystemExit(f"error: the preset's vocabulary ({vocab_size}) cannot hold byte tokens")
  return data


def _decode(tokens) -> str:
  return bytes(int(t) % 256 for t in tokens).decode("utf-8", errors="replace")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ddtree_jax.generate", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  parser.add_argument("--seed", type=int, default=0, help="parameter initialisation seed")
  parser.add_argument("--prompt", default="def fibonacci(n):")
  parser.add_argument("--max-new-tokens", type=int, default=48)
  parser.add_argument("--policy", default="ddtree", choices=policies.available_policies())
  parser.add_argument("--budget", type=int, default=8)
  parser.add_argument("--drafter", default="oracle", choices=("oracle", "random"))
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--compile-cache-dir", default=None)
  args = parser.parse_args(argv)
  if args.budget < 0:
    parser.error(f"--budget must be >= 0, got {args.budget}")
  if args.max_new_tokens <= 0:
    parser.error(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
  if args.temperature < 0:
    parser.error(f"--temperature must be >= 0, got {args.temperature}")

  cfg = PRESETS[args.preset]()
  model = kimi.init_model(cfg, args.seed)
  prompt = _encode(args.prompt, cfg.vocab_size)
  max_len = len(prompt) + args.max_new_tokens + args.budget + 64
  common = dict(batch_buckets=(1,), max_len=max_len, compile_cache_dir=args.compile_cache_dir)

  baseline = engine.SpeculativeDecoder(model, drafters.RandomDrafter(cfg.vocab_size), budgets=(0,), **common)
  t0 = time.perf_counter()
  reference = baseline.generate([prompt], args.max_new_tokens, budget=0, temperature=args.temperature,
                                stop_token_ids=[])
  ar_time = time.perf_counter() - t0 - reference.prefill_time

  if args.drafter == "oracle":
    drafter = drafters.OracleDrafter.make(drafters.greedy_continuations([prompt], reference.tokens),
                                          vocab_size=cfg.vocab_size, max_len=max_len)
  else:
    drafter = drafters.RandomDrafter(cfg.vocab_size)
  spec = engine.SpeculativeDecoder(model, drafter, policy=args.policy, budgets=(args.budget,), **common)
  t0 = time.perf_counter()
  result = spec.generate([prompt], args.max_new_tokens, temperature=args.temperature, stop_token_ids=[])
  spec_time = time.perf_counter() - t0 - result.prefill_time

  print(f"prompt: {args.prompt!r}")
  print(f"output: {_decode(result.tokens[0])!r}")
  print(f"preset {args.preset} (random weights), policy {args.policy}, budget {args.budget}, "
        f"drafter {args.drafter}")
  print(f"steps: {len(result.steps)} speculative vs {len(reference.steps)} autoregressive; "
        f"mean accepted length {result.mean_accepted_length:.2f}")
  print(f"decode time: {spec_time * 1e3:.0f} ms speculative, {ar_time * 1e3:.0f} ms autoregressive "
        f"(CPU, tiny model: not a speed measurement)")
  same = result.tokens == reference.tokens
  if args.temperature == 0:
    print("speculative output equals greedy decoding: " + ("yes" if same else "NO"))
  return 0 if same or args.temperature > 0 else 1


if __name__ == "__main__":
  sys.exit(main())
