"""The shipped kimi-demo pair on the CPU (float32): lossless and actually accepted."""

import json

import pytest

from ddtree_jax import engine
from ddtree_jax.near_tie import check_near_ties, greedy_reference
from models import dflash, loading

NUM_PROMPTS = 8
MAX_NEW = 48
# Measured on these prompts (float32, CPU, batch 8, mean over all rows of all steps): ddtree budget
# 16 tau 3.84. A drafter with a wrong layer convention, RoPE or stale context falls to about 1; the
# floor leaves a 14% margin.
TAU_FLOOR = 3.3


@pytest.fixture(scope="module")
def pair():
  target = loading.load_kimi("kimi-demo", dtype="float32", param_dtype="float32")
  draft = loading.load_dflash("kimi-demo-dflash", dtype="float32", param_dtype="float32")
  path = loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json"
  prompts = [p["tokens"] for p in json.loads(path.read_text())["prompts"][:NUM_PROMPTS]]
  return target, draft, prompts


def test_bundled_pair_loads_by_name_with_its_files(pair):
  target, draft, prompts = pair
  assert {"kimi-demo", "kimi-demo-dflash"} <= set(loading.bundled_models())
  assert target.cfg.vocab_size == 8192 and draft.cfg.block_size == 16
  assert draft.cfg.target_layer_ids == (1, 3) and draft.cfg.mask_token_id == 1
  assert len(prompts) == NUM_PROMPTS and all(len(p) == 128 for p in prompts)


def test_greedy_speculative_equals_target_and_keeps_a_tau_floor(pair):
  target, draft, prompts = pair
  max_len = 128 + MAX_NEW + 17
  reference = greedy_reference(target, prompts, MAX_NEW, max_len)
  dec = engine.SpeculativeDecoder(target, dflash.DFlashDrafter(draft.cfg), dflash.DFlashDrafter.params(draft, target),
                                  policy="ddtree", budgets=(16,), batch_buckets=(NUM_PROMPTS,), max_len=max_len,
                                  show_progress=False)
  result = dec.generate(prompts, MAX_NEW, stop_token_ids=[])
  ties = check_near_ties(result.tokens, *reference, dtype="float32", context="kimi-demo/ddtree/16")
  print(f"tau {result.mean_accepted_length:.2f}, near ties {ties}")
  assert result.mean_accepted_length > TAU_FLOOR


@pytest.mark.parametrize("configs", [
    (("ddtree", 64),),  # the largest budget: the bf16 drafter, tree and cache paths in one decoder
    pytest.param((("chain", 8), ("chain", 32), ("ddtree", 16)), marks=pytest.mark.slow),
])
def test_bf16_on_the_cpu_is_lossless_under_the_bf16_rule(configs):
  """bf16 weights and activations on the CPU (XLA CPU): speculative output equals greedy decoding
  under DESIGN's bf16 near-tie rule at the policies and budgets the GPU test runs (ddtree at 64 by
  default, the other three under ``-m slow``: the chain policy runs the same bf16 engine, drafter
  and cache code, and the float32 tests cover it at every budget).

  The GPU's bf16 runs leave the rule (README's open problem, also with the XLA target alone). On
  the CPU the target's rows do not depend on the rows beside them (``models/row_invariant.py``), so
  here (8 prompts x 48 tokens) every stream equals greedy exactly; without that module this test
  failed on an AVX2-only host (stream 3, token 27, margin 0.184) and passed on an AVX512-BF16 one.
  So it keeps the bf16 code path itself honest (dtype handling of the engine, drafter and cache,
  and the CPU's row invariance), and it points the GPU divergences at the GPU's kernels, whose
  rounding can depend on the batch shape, rather than at the model or the engine.
  """
  target = loading.load_kimi("kimi-demo", dtype="bfloat16", param_dtype="bfloat16")
  draft = loading.load_dflash("kimi-demo-dflash", dtype="bfloat16", param_dtype="bfloat16")
  path = loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json"
  prompts = [p["tokens"] for p in json.loads(path.read_text())["prompts"][:NUM_PROMPTS]]
  max_len = 128 + MAX_NEW + 65
  reference = greedy_reference(target, prompts, MAX_NEW, max_len)
  taus = {}
  for policy, budget in configs:
    dec = engine.SpeculativeDecoder(target, dflash.DFlashDrafter(draft.cfg), dflash.DFlashDrafter.params(draft, target),
                                    policy=policy, budgets=(budget,), batch_buckets=(NUM_PROMPTS,), max_len=max_len,
                                    show_progress=False)
    result = dec.generate(prompts, MAX_NEW, stop_token_ids=[])
    ties = check_near_ties(result.tokens, *reference, dtype="bfloat16", context=f"cpu/{policy}/{budget}/bfloat16")
    taus[policy] = max(taus.get(policy, 0.0), result.mean_accepted_length)
    print(f"bf16 {policy}/{budget}: tau {result.mean_accepted_length:.2f}, near ties {ties}")
  # The same floors as the GPU test: a broken drafter sits near 1.
  assert taus["ddtree"] > 2.5, taus
  if "chain" in taus:
    assert taus["chain"] > 2.0 and taus["ddtree"] > taus["chain"], taus
