"""``python -m ddtree_jax.serve``: an OpenAI-compatible server with speculative decoding.

    python -m ddtree_jax.serve                                   # the bundled demo pair on 127.0.0.1:8000
    python -m ddtree_jax.serve --spec none                       # plain autoregressive decoding
    python -m ddtree_jax.serve --budget 1:32,4:16,16:8 --max-batch 16 --api-key secret
    python -m ddtree_jax.serve --budget 1:32,4:16,64:4 --batch-buckets 1,4,64   # 3 compiled batch sizes
    python -m ddtree_jax.serve --attention-impl pallas --moe-impl pallas   # the Pallas kernels (GPU)
    python -m ddtree_jax.serve --policy-module my_policies.py --spec my_policy   # a policy of your own
    python -m ddtree_jax.serve --spec beam --policy-option width=4               # a policy's options

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health (200 once warm-up compilation is done), GET /metrics (Prometheus).
At temperature 0 a speculative server returns the text of ``--spec none`` (the target's greedy
decoding), exactly so with ``--dtype float32``; in bf16 (the demo pair's default) a stream may part
from it where two logits lie within bf16 rounding noise (README). At T > 0 it samples the target's
distribution.
"""

import argparse
import logging
import sys

from ddtree_jax import policies, policy_modules

PROG = "python -m ddtree_jax.serve"


def parse_args(argv=None):
  from serve.config import EXPERT_FORMATS, KERNEL_IMPLS, ServeConfig  # pylint: disable=import-outside-toplevel
  from serve.engine_loop import parse_batch_buckets  # pylint: disable=import-outside-toplevel
  defaults = ServeConfig()
  policy_modules.load_from_argv(argv, PROG)  # before --spec's choices are listed
  # Whole flags only: --policy-module was read by its own pass, which an abbreviation would skip.
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   allow_abbrev=False)
  parser.add_argument("--model", default=defaults.model, help="bundled model name or checkpoint directory")
  parser.add_argument("--drafter", default=defaults.drafter, help="bundled drafter name or checkpoint directory")
  parser.add_argument("--served-model-name", default=None, help="the name clients send as 'model' "
                      "(default: the model directory's name)")
  parser.add_argument("--spec", default=defaults.spec, choices=["none", *policies.available_policies()],
                      help="tree policy; 'none' decodes plainly (autoregressive)")
  policy_modules.add_argument(parser)
  parser.add_argument("--budget", default=defaults.budget,
                      help="tree budget: an int, or 'size:budget,...' by running batch size (a batch of n uses "
                           "the first entry with size >= n; the last covers larger batches)")
  parser.add_argument("--max-batch", type=int, default=None,
                      help=f"requests decoded together (default {defaults.max_batch}, or the largest --batch-buckets)")
  parser.add_argument("--batch-buckets", default=None,
                      help="batch sizes to compile, e.g. '1,4,16' (increasing; the largest is --max-batch); "
                           "default 1, 2, 4, ... up to --max-batch. Fewer buckets compile faster")
  parser.add_argument("--max-context", type=int, default=defaults.max_context,
                      help="prompt + generated tokens per request")
  parser.add_argument("--max-queue", type=int, default=defaults.max_queue,
                      help="requests that may wait for a batch row; more get 429")
  parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes, help="larger bodies get 413")
  parser.add_argument("--max-stop-ids", type=int, default=defaults.max_stop_ids,
                      help="stop token ids per request, the model's own included (a compiled shape)")
  parser.add_argument("--dtype", default=defaults.dtype, choices=("auto", "bfloat16", "float32"))
  parser.add_argument("--prefill-chunk", type=int, default=defaults.prefill_chunk,
                      help="prompt tokens per compiled prefill chunk")
  parser.add_argument("--host", default=defaults.host)
  parser.add_argument("--port", type=int, default=defaults.port)
  parser.add_argument("--compile-cache-dir", default=None, help="jax's persistent compilation cache")
  parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/ routes")
  parser.add_argument("--attention-impl", default=defaults.attention_impl, choices=KERNEL_IMPLS,
                      help="the target's tree attention: plain jnp (any backend) or the Pallas kernel (GPU)")
  parser.add_argument("--moe-impl", default=defaults.moe_impl, choices=KERNEL_IMPLS,
                      help="the target's routed experts: ragged_dot (any backend) or the Pallas kernel (GPU)")
  parser.add_argument("--experts", default=defaults.experts, choices=EXPERT_FORMATS,
                      help="the target's routed experts: as stored (auto), quantised to INT4 group-32 on load "
                           "(int4) or dequantised on load (dense)")
  parser.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs,
                      help="the most alternatives a request may ask for with its tokens' log-probabilities "
                           "(logprobs / top_logprobs, at most 20); -1 computes none")
  parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
  args = parser.parse_args(argv)
  try:
    max_batch = args.max_batch
    if max_batch is None:
      max_batch = parse_batch_buckets(args.batch_buckets)[-1] if args.batch_buckets else defaults.max_batch
    config = ServeConfig(model=args.model, drafter=args.drafter, served_model_name=args.served_model_name,
                         spec=args.spec, policy_options=policy_modules.parse_options(args.policy_option),
                         budget=args.budget, max_batch=max_batch, batch_buckets=args.batch_buckets,
                         max_context=args.max_context, max_queue=args.max_queue,
                         max_body_bytes=args.max_body_bytes, max_stop_ids=args.max_stop_ids,
                         dtype=args.dtype, prefill_chunk=args.prefill_chunk,
                         compile_cache_dir=args.compile_cache_dir, host=args.host, port=args.port,
                         api_key=args.api_key, attention_impl=args.attention_impl, moe_impl=args.moe_impl,
                         experts=args.experts, max_logprobs=args.max_logprobs)
    config.check_backend()
  except ValueError as err:
    parser.error(str(err))
  return config, args


def main(argv=None) -> int:
  config, args = parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  from serve.launch import serve_forever  # pylint: disable=import-outside-toplevel
  return serve_forever(config)


if __name__ == "__main__":
  sys.exit(main())
