"""GPU-only checks of the shipped pair (run on the device machine: ``pytest -m gpu tests/test_gpu.py``).

The CPU suite covers the same logic in float32; these show it holds on the GPU's kernels and in
bf16, where near ties are common and are counted under the bf16 tolerance.
"""

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_pair_lossless_and_accepted_on_gpu(dtype):
  # float32 matmuls at full precision: the GPU's default (TF32) rounds far above the 1e-4 rule.
  with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
    run_pair(dtype)


def run_pair(dtype):
  target, drafter, params = pair(dtype)
  ps = prompts()
  max_len = 128 + MAX_NEW + 65
  reference = greedy_reference(target, ps, MAX_NEW, max_len)
  taus = {}
  # Budgets 32 and 64 as well: the bf16 benchmark saw unexplained divergences there (README).
  for policy, budget in (("chain", 8), ("ddtree", 16), ("chain", 32), ("ddtree", 64)):
    dec = engine.SpeculativeDecoder(target, drafter, params, policy=policy, budgets=(budget,),
                                    batch_buckets=(NUM_PROMPTS,), max_len=max_len, show_progress=False)
    result = dec.generate(ps, MAX_NEW, stop_token_ids=[])
    ties = check_near_ties(result.tokens, *reference, dtype=dtype, context=f"{policy}/{budget}/{dtype}")
    taus[policy] = max(taus.get(policy, 0.0), result.mean_accepted_length)
    print(f"{dtype} {policy} budget {budget}: tau {taus[policy]:.2f}, near ties {ties}")
  # Floors under what the pair reaches on the CPU in float32 (ddtree 16: 3.84 over 48 tokens of
  # these prompts, tests/ddtree_jax/test_demo_pair.py): a broken drafter sits near 1.
  assert taus["chain"] > 2.0 and taus["ddtree"] > 2.5
  assert taus["ddtree"] > taus["chain"]
