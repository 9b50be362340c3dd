"""GPU-only checks of the shipped pair (run on the device machine: ``pytest -m gpu tests/test_gpu.py``).

The CPU suite covers the same logic in float32; these show it holds on the GPU's kernels and in
bf16, where near ties are common and are counted under the bf16 tolerance.
"""

import functools
import json

import jax
import numpy as np
import pytest

from ddtree_jax import engine
from ddtree_jax.near_tie import check_near_ties, greedy_reference
from models import dflash, loading

pytestmark = pytest.mark.gpu

NUM_PROMPTS = 8
MAX_NEW = 64
MAX_LEN = 128 + MAX_NEW + 65


@pytest.fixture(scope="module", autouse=True)
def needs_gpu():
  if jax.default_backend() != "gpu":
    pytest.fail("tests marked gpu need a CUDA GPU (run them on the device machine)")


def pair(dtype):
  target = loading.load_kimi("kimi-demo", dtype=dtype, param_dtype=dtype)
  draft = loading.load_dflash("kimi-demo-dflash", dtype=dtype, param_dtype=dtype)
  return target, dflash.DFlashDrafter(draft.cfg), dflash.DFlashDrafter.params(draft, target)


def prompts():
  path = loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json"
  return [p["tokens"] for p in json.loads(path.read_text())["prompts"][:NUM_PROMPTS]]


@functools.lru_cache(maxsize=None)
def reference(dtype):
  """The pair and plain greedy decoding of the prompts, once per dtype and process."""
  target, drafter, params = pair(dtype)
  ps = prompts()
  with matmul_precision(dtype):
    return target, drafter, params, ps, greedy_reference(target, ps, MAX_NEW, MAX_LEN)


def matmul_precision(dtype):
  # float32 matmuls at full precision: the GPU's default (TF32) rounds far above the 1e-4 rule.
  return jax.default_matmul_precision("highest" if dtype == "float32" else "default")


# Two (chain, ddtree) pairs of budgets, so that xdist runs them side by side; 32 and 64 as well as
# 8 and 16: the bf16 benchmark saw unexplained divergences there (README).
@pytest.mark.parametrize("budgets", [(8, 16), (32, 64)], ids=["budgets-8-16", "budgets-32-64"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_pair_lossless_and_accepted_on_gpu(dtype, budgets):
  target, drafter, params, ps, ref = reference(dtype)
  taus, failures = {}, []
  for policy, budget in zip(("chain", "ddtree"), budgets):
    with matmul_precision(dtype):
      dec = engine.SpeculativeDecoder(target, drafter, params, policy=policy, budgets=(budget,),
                                      batch_buckets=(NUM_PROMPTS,), max_len=MAX_LEN, show_progress=False)
      result = dec.generate(ps, MAX_NEW, stop_token_ids=[])
    taus[policy] = result.mean_accepted_length
    try:  # both budgets run before a failure is reported: one GPU run shows both
      ties = check_near_ties(result.tokens, *ref, dtype=dtype, context=f"{policy}/{budget}/{dtype}")
      print(f"{dtype} {policy} budget {budget}: tau {taus[policy]:.2f}, near ties {ties}")
    except AssertionError as err:
      failures.append(str(err))
  assert not failures, "; ".join(failures)
  # Floors under what the pair reaches on the CPU in float32 (ddtree 16: 3.84 over 48 tokens of
  # these prompts, tests/ddtree_jax/test_demo_pair.py): a broken drafter sits near 1.
  assert taus["chain"] > 2.0 and taus["ddtree"] > 2.5, taus
  assert taus["ddtree"] > taus["chain"], taus
