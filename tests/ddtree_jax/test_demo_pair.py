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
