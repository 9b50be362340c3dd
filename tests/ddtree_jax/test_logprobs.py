"""Log-probabilities of emitted tokens (``ddtree_jax.logprobs`` and ``SpeculativeDecoder(logprobs=n)``).

References are independent of the engine: numpy float64 ``log_softmax`` of the target's logits from
one teacher-forced prefill of prompt + generated tokens (no tree, no drafter, no verify walk).
The tiny random target in float32 on the CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import drafters, engine
from ddtree_jax import logprobs as logprobs_lib
from ddtree_jax.near_tie import check_near_ties, greedy_reference
from models import cache as cache_lib
from models import forward as fwd
from models import kimi
from models.config import KimiConfig

CFG = KimiConfig.tiny()
MAX_NEW = 24
MAX_LEN = 96
TOP_N = 3
# float32 logits of a chunked prefill against those of the verify window: they differ by ~1e-6
# here; a log-probability sums over the vocabulary, so it is compared at 2e-4.
ATOL = 2e-4


def log_softmax64(logits):
  z = np.asarray(logits, np.float64)
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("top_n", [0, 4])
def test_token_logprobs_match_numpy(top_n):
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (2, 7, 50)).astype(np.float32)
  nodes = rng.integers(0, 7, (2, 5)).astype(np.int32)
  tokens = rng.integers(0, 50, (2, 5)).astype(np.int32)
  got = jax.jit(logprobs_lib.token_logprobs, static_argnums=3)(logits, nodes, tokens, top_n)
  ref = log_softmax64(logits)
  at_node = np.take_along_axis(ref, nodes[:, :, None], axis=1)  # [B, Q, V]
  np.testing.assert_allclose(np.asarray(got.token), np.take_along_axis(at_node, tokens[:, :, None], 2)[..., 0],
                             atol=1e-5)
  assert got.top_ids.shape == got.top.shape == (2, 5, top_n)
  want_ids = np.argsort(-at_node, axis=-1, kind="stable")[..., :top_n]
  np.testing.assert_array_equal(np.asarray(got.top_ids), want_ids)
  np.testing.assert_allclose(np.asarray(got.top), np.take_along_axis(at_node, want_ids, -1), atol=1e-5)


def test_token_logprobs_rejects_a_negative_count():
  with pytest.raises(ValueError, match="top_n=-1"):
    logprobs_lib.token_logprobs(jnp.zeros((1, 1, 4)), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), -1)


def test_packed_output_carries_logprobs_bit_for_bit():
  rng = np.random.default_rng(1)
  b, q, n = 3, 6, 2
  special = np.asarray([-np.inf, -0.0, np.nan, -1e-45, -88.7, 0.0], np.float32)
  token = rng.normal(-3, 2, (b, q)).astype(np.float32)
  token[1] = special
  lp = logprobs_lib.TokenLogprobs(token=jnp.asarray(token), top_ids=jnp.asarray(rng.integers(0, 2**31 - 1, (b, q, n)), jnp.int32),
                                  top=jnp.asarray(rng.normal(-2, 1, (b, q, n)), jnp.float32))
  out = engine.StepOutput(emitted=jnp.asarray(rng.integers(0, 1000, (b, q)), jnp.int32),
                          num_emitted=jnp.asarray([0, 6, 2], jnp.int32), num_accepted=jnp.asarray([0, 5, 2], jnp.int32),
                          tree_size=jnp.asarray([1, 6, 4], jnp.int32), finished=jnp.asarray([False, False, True]),
                          sibling_accepts=jnp.asarray([0, 1, 0], jnp.int32), experts_touched=jnp.asarray(5, jnp.int32),
                          logprobs=lp)
  packed = np.asarray(jax.jit(engine.pack_output)(out))
  assert packed.shape == (b, q * (2 + 2 * n) + 6)
  back = engine.unpack_output(packed, n)
  np.testing.assert_array_equal(back.emitted, np.asarray(out.emitted))
  np.testing.assert_array_equal(back.num_emitted, [0, 6, 2])
  assert back.finished.tolist() == [False, False, True] and int(back.experts_touched) == 5
  for field in ("token", "top_ids", "top"):
    want = np.asarray(getattr(lp, field))
    np.testing.assert_array_equal(getattr(back.logprobs, field).view(np.int32), want.view(np.int32), err_msg=field)
  entries = logprobs_lib.host_entries(back.logprobs, 0, 2)
  assert [e.logprob for e in entries] == token[0, :2].tolist()
  assert entries[1].top == tuple(zip(np.asarray(lp.top_ids)[0, 1].tolist(), np.asarray(lp.top)[0, 1].tolist()))


@pytest.fixture(scope="module")
def model():
  return kimi.init_model(CFG, seed=0)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(7)
  return [rng.integers(3, CFG.vocab_size, n).tolist() for n in (5, 17, 30)]


@pytest.fixture(scope="module")
def reference(model, prompts):
  return greedy_reference(model, prompts, MAX_NEW, MAX_LEN)


@pytest.fixture(scope="module")
def dec(model, prompts, reference):
  """Budgets 0 and 8, a bucket of 4 (so a batch of 3 carries a padding row), an oracle drafter of
  the greedy continuations (drafts are accepted, so tokens come from nodes deep in the tree),
  prompts prefilled in chunks of 16 (two of the three span chunks)."""
  continuations = drafters.greedy_continuations(prompts, reference[0])
  drafter = drafters.OracleDrafter.make(continuations, vocab_size=CFG.vocab_size, max_len=MAX_LEN, noise=0.2)
  return engine.SpeculativeDecoder(model, drafter, policy="ddtree", budgets=(0, 8), batch_buckets=(4,),
                                   max_len=MAX_LEN, prefill_chunk=16, logprobs=TOP_N, show_progress=False)


def teacher_forced_logprobs(model, prompt, generated):
  """float64[len(generated), V]: log_softmax of the logits that predict each generated token."""
  sequence = list(prompt) + list(generated)
  cache = cache_lib.init_cache(model.cfg, 1, MAX_LEN)
  with fwd.matmul_precision(model.cfg):
    _, logits, _, _ = fwd.prefill(model, [sequence], np.arange(1), cache, chunk_size=16, all_logits=True)
  rows = np.asarray(logits)[0, len(prompt) - 1:len(sequence) - 1]
  return log_softmax64(rows)


def check_against_reference(model, prompt, tokens, entries, *, greedy: bool):
  assert len(entries) == len(tokens) > 0
  ref = teacher_forced_logprobs(model, prompt, tokens)
  got = np.asarray([e.logprob for e in entries])
  want = ref[np.arange(len(tokens)), tokens]
  np.testing.assert_allclose(got, want, atol=ATOL)
  for t, (entry, row) in enumerate(zip(entries, ref)):
    ids = [i for i, _ in entry.top]
    assert len(ids) == TOP_N
    order = np.argsort(-row, kind="stable")
    gaps = -np.diff(row[order[:TOP_N + 1]])
    if gaps.min() > ATOL:  # no near tie among the top N + 1: the ids are determined
      assert ids == order[:TOP_N].tolist(), f"token {t}"
    np.testing.assert_allclose([lp for _, lp in entry.top], row[ids], atol=ATOL)
    if greedy and gaps[0] > ATOL:
      assert tokens[t] == ids[0] and abs(entry.logprob - entry.top[0][1]) < 1e-6


@pytest.mark.parametrize("budget", [0, 8])
def test_greedy_logprobs_equal_the_teacher_forced_target(model, prompts, reference, dec, budget):
  result = dec.generate(prompts, MAX_NEW, budget=budget, stop_token_ids=[])
  check_near_ties(result.tokens, *reference, dtype="float32", context=f"logprobs on, budget {budget}")
  if budget:  # the oracle's drafts are accepted: tokens come from deep tree nodes, not only roots
    assert result.mean_accepted_length > 2.0
  assert result.logprobs is not None and len(result.logprobs) == len(prompts)
  for prompt, tokens, entries in zip(prompts, result.tokens, result.logprobs):
    check_against_reference(model, prompt, tokens, entries, greedy=True)


def test_sampled_logprobs_are_the_raw_distribution(model, prompts, dec):
  """At T > 0 a token's logprob is the target's unprocessed log_softmax (not the tempered, top-k
  cut distribution it was drawn from)."""
  result = dec.generate(prompts, MAX_NEW, budget=8, temperature=1.5, top_k=4, seed=[3, 4, 5], stop_token_ids=[])
  for prompt, tokens, entries in zip(prompts, result.tokens, result.logprobs):
    check_against_reference(model, prompt, tokens, entries, greedy=False)
    ref = teacher_forced_logprobs(model, prompt, tokens)
    ranks = [(row > row[t]).sum() for row, t in zip(ref, tokens)]
    assert max(ranks) < 4  # drawn within the top 4, as top_k asked
  # Temperature 1.5 spreads the draws: not all of them the argmax.
  assert any(e.logprob < e.top[0][1] - 1e-3 for entries in result.logprobs for e in entries)


def test_a_request_ended_by_its_first_token_has_its_logprob(model, prompts, dec):
  result = dec.generate(prompts[:1], 1, budget=8, stop_token_ids=[])
  assert len(result.tokens[0]) == len(result.logprobs[0]) == 1
  check_against_reference(model, prompts[0], result.tokens[0], result.logprobs[0], greedy=True)


def test_without_logprobs_none_are_returned(model):
  plain = engine.SpeculativeDecoder(model, drafters.RandomDrafter(CFG.vocab_size), policy="chain", budgets=(0,),
                                    batch_buckets=(1,), max_len=32, prefill_chunk=16, show_progress=False)
  result = plain.generate([[5, 6, 7]], 3, stop_token_ids=[])
  assert result.logprobs is None and plain.logprobs is None
  with pytest.raises(engine.EngineError, match="prompt_logprobs needs a decoder that computes"):
    plain.request([5, 6, 7], 3, prompt_logprobs=True)


@pytest.mark.parametrize("value", [-1, True, 1.5, CFG.vocab_size + 1, "3"])
def test_bad_logprobs_setting_is_named(model, value):
  with pytest.raises(engine.EngineError, match="logprobs="):
    engine.SpeculativeDecoder(model, drafters.RandomDrafter(CFG.vocab_size), policy="chain", budgets=(0,),
                              batch_buckets=(1,), max_len=32, prefill_chunk=16, logprobs=value, show_progress=False)


def test_a_stop_id_that_cuts_a_speculative_step_keeps_one_entry_a_token(model, prompts, reference, dec):
  """A stop id found mid-step ends the request there: the tokens drafted past it are dropped, and
  so are their log-probabilities."""
  stream = reference[0][1]
  stop = stream[9]
  cut = stream.index(stop) + 1  # its first occurrence ends the request
  result = dec.generate([prompts[1]], MAX_NEW, budget=8, stop_token_ids=[stop])
  assert result.tokens[0] == stream[:cut] and result.finish_reasons == ["stop"]
  assert len(result.logprobs[0]) == cut
  check_against_reference(model, prompts[1], result.tokens[0], result.logprobs[0], greedy=True)


def test_only_requests_that_want_logprobs_keep_them(model, prompts, dec):
  """A server keeps log-probabilities only for the requests that asked (building them is host work
  every step); the others' tokens are the same either way."""
  batch = engine.Batch(dec, 4)
  wanting = dec.request(prompts[0], 12, stop_token_ids=[])
  not_wanting = dec.request(prompts[0], 12, stop_token_ids=[], logprobs=False)
  batch.admit(wanting)
  batch.admit(not_wanting)
  while batch.num_running:
    batch.collect(batch.dispatch(8))
  assert wanting.tokens == not_wanting.tokens and len(wanting.tokens) == 12
  assert len(wanting.logprobs) == 12 and not_wanting.logprobs == []
  check_against_reference(model, prompts[0], wanting.tokens, wanting.logprobs, greedy=True)


def test_a_packed_output_read_with_the_wrong_count_is_refused():
  packed = np.zeros((2, 5 * (2 + 2 * 3) + 6), np.int32)
  assert engine.unpack_output(packed, 3).logprobs.top.shape == (2, 5, 3)
  with pytest.raises(ValueError, match="holds no logprobs with top_n=2"):
    engine.unpack_output(packed, 2)


def test_prompt_logprobs_equal_the_teacher_forced_target_across_chunks(model, prompts, dec):
  """``echo`` with logprobs: each prompt token's log-probability given the tokens before it, from
  the prefill's chunks (30 tokens in chunks of 16: a chunk's last row predicts the next chunk's
  first token)."""
  batch = engine.Batch(dec, 4)
  requests = [dec.request(p, 3, stop_token_ids=[], prompt_logprobs=True) for p in prompts[1:]]
  plain = dec.request(prompts[2], 3, stop_token_ids=[])
  for request in (*requests, plain):
    batch.admit(request)
  while batch.num_running:
    batch.collect(batch.dispatch(8))
  for prompt, request in zip(prompts[1:], requests):
    assert len(request.prompt_logprobs) == len(prompt) - 1 and len(request.logprobs) == 3
    check_against_reference(model, prompt[:1], prompt[1:], request.prompt_logprobs, greedy=False)
  assert plain.prompt_logprobs == [] and plain.tokens == requests[1].tokens
