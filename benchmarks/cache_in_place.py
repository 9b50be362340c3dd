"""The demo target's verify step against the cache pool's size: does a step's cost follow the batch or the pool?

    PYTHONPATH=. python3 benchmarks/cache_in_place.py --out benchmarks/results                 # on the GPU
    PYTHONPATH=. python3 benchmarks/cache_in_place.py --before old_kimi.py --name cache_in_place_before

Until 12cb2d6 the layer scan passed ``c_kv[layer_id]`` to each layer and set it back, so XLA copied the
layer's whole pool (every slot and column) out and back at every layer of every step. The scan now
writes each window into the whole cache in place. For each attention implementation, batch and
pool (slots x columns), this times one jitted verify step of 17 window rows (budget 16) over a
committed prefix of ``--prefix`` tokens in each request's slot, the cache donated as the engine
donates it: the median wall time of ``--calls`` steps, each read back (``block_until_ready``). (No
CUPTI device time: its profiler reruns a call on the same arguments, which a donated cache forbids,
and without donation the step must copy the whole cache.)

``--before FILE`` loads FILE as ``models.kimi`` (e.g. ``git show df13db6:models/kimi.py``, the form
before the change; it shares every other module), so both forms run in one device call, one process
each. Weights are the demo's random initialisation (a step's cost does not depend on their values
beyond routing, which is fixed by the seed). Writes ``NAME.{json,md}`` (``--name``) after every cell,
so a run cut short keeps the cells it timed. (On an H100 the first run, with 64 x 32768 pools and the
"xla" cells first, did not finish two forms in 2 x 120 s; the defaults are smaller now.)
"""

import importlib.util
import pathlib
import statistics
import sys
import time

import numpy as np

import results_io


def use_kimi_module(path: pathlib.Path) -> None:
  """Makes ``path`` the ``models.kimi`` every later import sees."""
  import models

  spec = importlib.util.spec_from_file_location("models.kimi", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["models.kimi"] = module
  spec.loader.exec_module(module)
  models.kimi = module


Q_LEN = 17  # a budget-16 tree and its root


def time_step(verify_step, model, num_slots: int, columns: int, batch: int, prefix: int, calls: int) -> dict:
  """One cell: ``verify_step(model, cache, *window)`` (jitted, the cache donated) over a fresh pool of
  ``num_slots`` x ``columns`` whose slots hold ``prefix`` committed tokens, for a chain window of
  Q_LEN rows in slots 0..batch-1. Checks that the step wrote exactly those slots' window rows.
  Returns the table row (median wall ms of ``calls`` steps after one warm-up)."""
  import jax
  import jax.numpy as jnp

  from models import cache as cache_lib

  cfg = model.cfg
  cache = cache_lib.init_cache(cfg, num_slots, columns)
  cache = cache_lib.advance(cache, jnp.arange(num_slots, dtype=jnp.int32), jnp.full((num_slots,), prefix, jnp.int32))
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, Q_LEN)), jnp.int32)
  window = (tokens, jnp.broadcast_to(prefix + jnp.arange(Q_LEN, dtype=jnp.int32), (batch, Q_LEN)),
            jnp.broadcast_to(jnp.tril(jnp.ones((Q_LEN, Q_LEN), bool)), (batch, Q_LEN, Q_LEN)),
            jnp.ones((batch, Q_LEN), bool), jnp.arange(batch, dtype=jnp.int32))
  cache = jax.block_until_ready(verify_step(model, cache, *window))  # compile and warm up
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    cache = jax.block_until_ready(verify_step(model, cache, *window))
    times.append((time.perf_counter() - start) * 1e3)
  # Rows written per (layer, slot, column): the window's, in the batch's slots, and nothing else.
  written = np.asarray(jnp.any(cache.c_kv != 0, axis=-1))
  expected = np.zeros_like(written)
  expected[:, :batch, prefix:prefix + Q_LEN] = True
  if not (written == expected).all() or int(cache.lengths[0]) != prefix:
    raise RuntimeError(f"the verify step did not write exactly the window's rows (pool {num_slots}x{columns}, "
                       f"batch {batch})")
  return dict(batch=batch, slots=num_slots, columns=columns,
              layer_pool_mb=round((cache.c_kv.nbytes + cache.k_pe.nbytes) / cfg.num_hidden_layers / 2**20, 1),
              wall_ms=round(statistics.median(times), 3))


def markdown(result: dict) -> str:
  lines = [f"The {result['model']} target's verify step, {Q_LEN} window rows over {result['prefix']} committed "
           f"tokens a slot ({result['device']}, {result['form']}): median wall ms of {result['calls']} steps, "
           "each read back, the cache donated.",
           "", "| attention | batch | slots | columns | one layer's pool (MB) | step (ms) |",
           "| --- | --- | --- | --- | --- | --- |"]
  lines += [f"| {r['impl']} | {r['batch']} | {r['slots']} | {r['columns']} | {r['layer_pool_mb']} | {r['wall_ms']:.3f} |"
            for r in result["rows"]]
  return results_io.with_command(lines, result)


def main():
  parser = results_io.results_parser(__doc__, "cache_in_place")
  parser.add_argument("--before", type=pathlib.Path, help="a kimi.py to load as models.kimi")
  parser.add_argument("--model", choices=("demo", "tiny"), default="demo", help="the target's config")
  parser.add_argument("--impls", default="pallas,xla", help="attention_impl values ('pallas' on the GPU only)")
  parser.add_argument("--batches", default="1,16")
  parser.add_argument("--pools", default="16x1024,16x4096,64x4096,64x16384",
                      help="slots x columns, comma-separated")
  parser.add_argument("--prefix", type=int, default=512, help="committed tokens in each slot")
  parser.add_argument("--calls", type=int, default=30)
  args = parser.parse_args()
  results_io.check_positive(parser, prefix=args.prefix, calls=args.calls)
  try:
    pools = [tuple(int(n) for n in pool.split("x")) for pool in args.pools.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
  except ValueError:
    parser.error(f"--pools takes SLOTSxCOLUMNS,... and --batches integers, got {args.pools!r} and {args.batches!r}")
  if args.before:
    use_kimi_module(args.before)

  import jax

  from models import forward as fwd
  from models import kimi
  from models.config import KimiConfig

  start_time = time.perf_counter()
  on_gpu = jax.default_backend() == "gpu"
  rows = []
  for impl in [i for i in args.impls.split(",") if on_gpu or i == "xla"]:
    cfg = getattr(KimiConfig, args.model)(attention_impl=impl, dtype="bfloat16" if on_gpu else "float32")
    model = kimi.init_model(cfg, seed=0)

    def step(model, cache, tokens, positions, visibility, valid, slots):
      return fwd.verify(model, tokens, positions, visibility, valid, slots, cache)[2]

    verify_step = jax.jit(step, donate_argnums=1)
    for num_slots, columns in pools:
      for batch in batches:
        if batch <= num_slots and args.prefix + Q_LEN <= columns:
          rows.append(dict(impl=impl, **time_step(verify_step, model, num_slots, columns, batch, args.prefix,
                                                  args.calls)))
          print(rows[-1], flush=True)
          # After every cell, so that a run cut short (a device call's time limit) keeps its rows.
          results_io.save_rows(rows, out=args.out, name=args.name,
                               command=" ".join(["benchmarks/cache_in_place.py"] + sys.argv[1:]), start=start_time,
                               markdown=markdown, merge=False, cell=None, model=args.model, prefix=args.prefix,
                               calls=args.calls, form=f"models.kimi from {args.before}" if args.before else "in place")


if __name__ == "__main__":
  main()
