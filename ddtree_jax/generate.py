"""Command-line generation with speculative decoding, checked against plain decoding of the target.

    python -m ddtree_jax.generate                        # the bundled demo pair, a code prompt
    python -m ddtree_jax.generate --prompt "import os" --policy chain --budget 8 --max-new-tokens 96
    python -m ddtree_jax.generate --attention-impl pallas --moe-impl pallas --dtype bfloat16   # on a GPU
    python -m ddtree_jax.generate --policy-module my_policies.py --policy my_policy   # a policy of your own

The defaults run the bundled ``kimi-demo`` target (a 16M-parameter Kimi-architecture model trained
on Python sources) with its DFlash drafter. Unless ``--no-compare`` is given, the same prompt is
also decoded plainly and the command reports whether the token streams are identical. At
temperature 0, streams that differ are judged against an engine-independent greedy decoding by
DESIGN's near-tie rule (the decisive top-2 logit margin below 1e-4 in float32, 1e-2 in bf16): the
command exits 1 when the speculative stream differs anywhere else, or at T > 0 when the streams
differ at all.
"""

import argparse
import math
import sys

import jax

from ddtree_jax import drafters, engine, near_tie, policies, policy_modules
from models import dflash, loading
from models.config import EXPERT_FORMATS, KERNEL_IMPLS, expert_format_overrides, kernel_backend_error, kernel_dtype_error
from serve.text import TextCodec

# No trailing newline: the tokenizer merges a newline with the next line's indentation, so a
# prompt that stops after "\n" leaves the model at a token boundary it never saw in training.
DEFAULT_PROMPT = 'def read_config(path):\n    """Read a JSON configuration file and return it as a dict."""'


PROG = "python -m ddtree_jax.generate"


def main(argv=None) -> int:
  policy_modules.load_from_argv(argv, PROG)  # before --policy's choices are listed
  # Whole flags only: --policy-module was read by its own pass, which an abbreviation would skip.
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   allow_abbrev=False)
  parser.add_argument("--model", default="kimi-demo", help="bundled model name or checkpoint directory")
  parser.add_argument("--drafter", default="kimi-demo-dflash", help="bundled drafter name or directory")
  parser.add_argument("--prompt", default=DEFAULT_PROMPT)
  parser.add_argument("--max-new-tokens", type=int, default=96)
  parser.add_argument("--policy", default="ddtree", choices=policies.available_policies())
  policy_modules.add_argument(parser)
  parser.add_argument("--budget", type=int, default=16, help="tree nodes per step; 0 = autoregressive")
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--no-compare", action="store_true", help="skip the plain decoding for comparison")
  parser.add_argument("--compile-cache-dir", default=None)
  parser.add_argument("--attention-impl", default="xla", choices=KERNEL_IMPLS,
                      help="the target's tree attention: plain jnp (any backend) or the Pallas kernel (GPU)")
  parser.add_argument("--moe-impl", default="xla", choices=KERNEL_IMPLS,
                      help="the target's routed experts: ragged_dot (any backend) or the Pallas kernel (GPU)")
  parser.add_argument("--experts", default="auto", choices=EXPERT_FORMATS,
                      help="the target's routed experts: as stored (auto), quantised to INT4 group-32 on load "
                           "(int4) or dequantised on load (dense)")
  args = parser.parse_args(argv)
  for name, ok in (("--budget", args.budget >= 0), ("--max-new-tokens", args.max_new_tokens > 0),
                   ("--temperature", 0 <= args.temperature < math.inf), ("--top-p", 0 < args.top_p <= 1),
                   ("--seed", 0 <= args.seed < 2**32)):
    if not ok:
      parser.error(f"{name} out of range: {getattr(args, name[2:].replace('-', '_'))}")
  error = (kernel_backend_error(jax.default_backend(), attention_impl=args.attention_impl, moe_impl=args.moe_impl)
           or kernel_dtype_error(args.dtype, attention_impl=args.attention_impl, moe_impl=args.moe_impl))
  if error:
    parser.error(error)
  try:
    options = policy_modules.parse_options(args.policy_option)
    policies.get_policy(args.policy, **options)  # an option the policy does not take, before any loading
  except ValueError as err:
    parser.error(str(err))

  try:
    model_dir = loading.resolve_model_dir(args.model)
    target = loading.load_kimi(model_dir, dtype=args.dtype, param_dtype=args.dtype,
                               **expert_format_overrides(args.experts), attention_impl=args.attention_impl, moe_impl=args.moe_impl)
    draft = loading.load_dflash(args.drafter, dtype=args.dtype, param_dtype=args.dtype)
    try:
      drafter_params = dflash.DFlashDrafter.params(draft, target)  # refuses a drafter of another target
    except ValueError as err:
      raise ValueError(f"--drafter {args.drafter} does not fit --model {args.model}: {err}") from None
    # The server's text handling: tokenizer.json or Kimi's tiktoken.model, the BOS its config asks for.
    codec = TextCodec.from_model_dir(model_dir, eos_token_id=target.cfg.eos_token_id, chat=False)
    prompt = codec.completion_prompt(args.prompt)
  except (FileNotFoundError, KeyError, ValueError) as err:  # TextError is a ValueError
    parser.error(str(err))
  stops = list(codec.stop_ids)
  max_len = len(prompt) + args.max_new_tokens + max(args.budget, draft.cfg.block_size) + 1
  sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop_token_ids=stops)
  # A short prompt and few new tokens make a cache shorter than the engine's default prefill chunk.
  common = dict(batch_buckets=(1,), max_len=max_len, prefill_chunk=min(64, max_len),
                compile_cache_dir=args.compile_cache_dir, max_stop_tokens=max(1, len(stops)))

  try:
    spec = engine.SpeculativeDecoder(target, dflash.DFlashDrafter(draft.cfg), drafter_params,
                                     policy=args.policy, policy_options=options, budgets=(args.budget,), **common)
  except engine.EngineError as err:  # e.g. a --policy-module policy whose tree the step refuses
    parser.error(str(err))
  result = spec.generate([prompt], args.max_new_tokens, **sampling)
  text = codec.decode(result.tokens[0])  # special tokens (the stop id among them) left out
  print(args.prompt + text)
  print("-" * 72)
  experts = ", INT4 experts" if target.cfg.experts_int4 else ""
  print(f"{args.model} + {args.drafter}, policy {args.policy}, budget {args.budget}, {args.dtype}{experts}: "
        f"{len(result.tokens[0])} tokens in {len(result.steps)} steps, mean accepted length "
        f"{result.mean_accepted_length:.2f}, decode {result.decode_time * 1e3:.0f} ms ({result.finish_reasons[0]})")
  if args.no_compare:
    return 0
  plain = engine.SpeculativeDecoder(target, drafters.RandomDrafter(target.cfg.vocab_size), budgets=(0,), **common)
  reference = plain.generate([prompt], args.max_new_tokens, **sampling)
  same = reference.tokens == result.tokens
  print(f"plain decoding: {len(reference.steps)} steps, decode {reference.decode_time * 1e3:.0f} ms; "
        f"speculative output {'identical' if same else 'DIFFERENT'} "
        f"({'greedy' if args.temperature == 0 else 'seeded sampling: keys depend on seed and position only'})")
  if same or args.temperature > 0:
    return 0 if same else 1
  return 0 if near_tie_report(target, prompt, result.tokens[0], reference.tokens[0], args.dtype, stops,
                              args.max_new_tokens, max_len) else 1


def near_tie_report(target, prompt, speculative, plain, dtype: str, stop_ids, max_new_tokens: int,
                    max_len: int) -> bool:
  """Where greedy streams differ, judges each against an engine-independent greedy decoding
  (``near_tie.greedy_reference``: one token a step, cut after its first of ``stop_ids``) by DESIGN's near-tie
  rule and prints the verdicts. True when the speculative stream differs from it only at a near
  tie; a plain stream that leaves it is reported (a bug of the plain engine, or noise), not fatal."""
  # Its own cache: the reference prefills whole chunks, which the engines' cache need not hold.
  chunk = near_tie.PREFILL_CHUNK
  ref_tokens, ref_margins = near_tie.greedy_reference(
      target, [prompt], max_new_tokens, max(max_len, -(-len(prompt) // chunk) * chunk + max_new_tokens + 1))
  stop_at = next((i for i, t in enumerate(ref_tokens[0]) if t in stop_ids), None)
  ref = ref_tokens[0] if stop_at is None else ref_tokens[0][:stop_at + 1]
  tolerance = near_tie.TOLERANCE[dtype]
  verdicts = {}
  for name, tokens in (("speculative", speculative), ("plain", plain)):
    verdict, = near_tie.classify([tokens], [ref], ref_margins, dtype)
    verdicts[name] = verdict
    if verdict is None:
      print(f"{name} output equals greedy decoding one token a step")
    elif verdict[2] == float("inf"):  # equal as far as both go
      print(f"{name} output ends after {len(tokens)} tokens where greedy decoding one token a step has "
            f"{len(ref)}: NOT a near tie")
    else:
      kind, index, margin = verdict
      judged = (f"a near tie (< {tolerance} in {dtype}), allowed" if kind == "tie"
                else f"NOT a near tie (>= {tolerance} in {dtype})")
      print(f"{name} output first differs from greedy decoding one token a step at token {index}, where its "
            f"top-2 logit margin is {margin:.3g}: {judged}")
  return verdicts["speculative"] is None or verdicts["speculative"][0] == "tie"


if __name__ == "__main__":
  sys.exit(main())
