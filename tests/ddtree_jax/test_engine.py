"""The speculative decoding engine on the tiny random target (float32, CPU).

Lossless (token equality with the near-tie rule), acceptance (exact oracles), sampling
invariances, budget switching, batching, compilation behaviour and bad input.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import drafters, engine
from ddtree_jax import verify as verify_lib
from models import cache as cache_lib
from models import forward as fwd
from models import kimi
from models.config import KimiConfig
from ddtree_jax.near_tie import check_near_ties, greedy_reference

CFG = KimiConfig.tiny()
MAX_NEW = 48
MAX_LEN = 160
PROMPT_LENGTHS = (4, 13, 29)
L = 15  # oracle/random drafter depth (DFlash block 16)


@pytest.fixture(scope="module")
def model():
  return kimi.init_model(CFG, seed=0)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(7)
  # Avoid EOS in prompts only for readability; stop tokens are switched off in these tests.
  return [rng.integers(3, CFG.vocab_size, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(model, prompts):
  return greedy_reference(model, prompts, MAX_NEW, MAX_LEN)


def make_drafter(kind, prompts, reference_tokens):
  continuations = drafters.greedy_continuations(prompts, reference_tokens)
  if kind == "oracle":
    return drafters.OracleDrafter.make(continuations, vocab_size=CFG.vocab_size, max_len=MAX_LEN)
  if kind == "noisy":
    return drafters.OracleDrafter.make(continuations, vocab_size=CFG.vocab_size, max_len=MAX_LEN, noise=0.35)
  return drafters.RandomDrafter(CFG.vocab_size)


def decoder(model, drafter, policy, budgets, bucket, **kwargs):
  return engine.SpeculativeDecoder(model, drafter, policy=policy, budgets=budgets, batch_buckets=(bucket,),
                                   max_len=MAX_LEN, show_progress=False, **kwargs)


def run_lossless(model, prompts, reference, policy, drafter_kind, budgets, batch):
  dec = decoder(model, make_drafter(drafter_kind, prompts, reference[0]), policy, budgets, batch)
  ties = 0
  for budget in budgets:
    groups = [prompts] if batch == 3 else [[p] for p in prompts]
    got = []
    for group in groups:
      got += dec.generate(group, MAX_NEW, budget=budget, stop_token_ids=[]).tokens
    ties += check_near_ties(got, *reference, dtype="float32",
                            context=f"{policy}/{drafter_kind}/budget {budget}/batch {batch}")
  return ties


# Every budget, every policy x drafter pair, and both batch sizes for every policy (float32).
BUDGETS = (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 5, 41)  # the last two drawn at random once
POLICIES = ("ddtree", "chain", "beam", "static")
DRAFTERS = ("oracle", "noisy", "random")
# Written out rather than generated so that three cases are decoders the tests below build as well
# (budget 4: the jit test's, 8: the random-drafter tests', 16: the sibling test's chain), whose
# compiled steps the persistent cache then serves: each distinct step costs seconds to compile.
DESIGN = [
    (1, "ddtree", "oracle", 1), (2, "chain", "oracle", 3), (3, "beam", "oracle", 1), (4, "ddtree", "noisy", 1),
    (5, "static", "oracle", 3), (7, "beam", "noisy", 3), (8, "ddtree", "random", 3), (15, "static", "noisy", 1),
    (16, "chain", "noisy", 3), (31, "chain", "random", 1), (32, "beam", "random", 3), (41, "static", "random", 1),
    (63, "chain", "oracle", 1), (64, "ddtree", "noisy", 3),
]


@pytest.mark.parametrize("budget, policy, drafter_kind, batch", DESIGN)
def test_greedy_speculative_equals_autoregressive(model, prompts, reference, budget, policy, drafter_kind, batch):
  ties = run_lossless(model, prompts, reference, policy, drafter_kind, (budget,), batch)
  print(f"near ties: {ties}")


@pytest.mark.slow
@pytest.mark.parametrize("policy, drafter_kind, batch", list(itertools.product(POLICIES, DRAFTERS, (1, 3))))
def test_greedy_lossless_full_cross_product(model, prompts, reference, policy, drafter_kind, batch):
  run_lossless(model, prompts, reference, policy, drafter_kind, BUDGETS, batch)


def test_design_covers_every_value_and_every_policy_drafter_pair():
  assert sorted(d[0] for d in DESIGN) == sorted(BUDGETS)
  assert {(d[1], d[2]) for d in DESIGN} == set(itertools.product(POLICIES, DRAFTERS))
  assert {(d[1], d[3]) for d in DESIGN} == set(itertools.product(POLICIES, (1, 3)))


# ---- acceptance ---------------------------------------------------------------------------------
def test_noise_free_oracle_chain_accepts_whole_draft_every_step(model, prompts, reference):
  budget = 8
  dec = decoder(model, make_drafter("oracle", prompts, reference[0]), "chain", (budget,), 3)
  result = dec.generate(prompts, MAX_NEW, budget=budget, stop_token_ids=[])
  check_near_ties(result.tokens, *reference)
  produced = [1] * len(prompts)  # the first token comes from prefill
  for step in result.steps:
    for row, (accepted, size) in enumerate(zip(step.accepted, step.tree_size)):
      remaining = MAX_NEW - produced[row]
      assert size == min(budget, L, remaining - 1) + 1
      assert accepted == size  # the whole chain plus the bonus
      produced[row] += accepted
  assert produced == [MAX_NEW] * 3
  assert len(result.steps) == -(-(MAX_NEW - 1) // (budget + 1))
  assert result.steps[0].accepted == [budget + 1] * 3


def test_greedy_stop_tokens_inside_accepted_paths_cut_as_plain_decoding(model, prompts, reference):
  """Stop tokens are the only place the lossless tests above leave out (they pass none): with
  two of the reference's own tokens as stop tokens, each stream ends at the first of them,
  inclusive, exactly where plain greedy decoding would; the oracle chain accepts whole paths, so
  a stop lies inside an accepted path (not on the bonus token), which ``accept`` must cut."""
  budget = 8
  ref_tokens, ref_margins = reference
  stops = {ref_tokens[0][10], ref_tokens[1][21]}
  cut = [next((i + 1 for i, t in enumerate(row) if t in stops), len(row)) for row in ref_tokens]
  assert cut[0] <= 11 and cut[1] <= 22  # both streams stop early
  # With whole paths of budget + 1 tokens after the first, position i is a path token unless
  # (i - 1) % (budget + 1) == budget (the bonus).
  assert any(c < MAX_NEW and (c - 2) % (budget + 1) != budget for c in cut)
  dec = decoder(model, make_drafter("oracle", prompts, ref_tokens), "chain", (budget,), 3)
  got = dec.generate(prompts, MAX_NEW, budget=budget, stop_token_ids=sorted(stops)).tokens
  check_near_ties(got, [row[:c] for row, c in zip(ref_tokens, cut)], [m[:c] for m, c in zip(ref_margins, cut)],
                  context="stop tokens")
  assert [len(row) for row in got] == cut


def test_noisy_oracle_ddtree_recovers_through_siblings_and_beats_chain(model, prompts, reference):
  budget = 16
  drafter = make_drafter("noisy", prompts, reference[0])
  tree = decoder(model, drafter, "ddtree", (budget,), 3).generate(prompts, MAX_NEW, stop_token_ids=[])
  chain = decoder(model, drafter, "chain", (budget,), 3).generate(prompts, MAX_NEW, stop_token_ids=[])
  check_near_ties(tree.tokens, *reference)
  check_near_ties(chain.tokens, *reference)
  sibling = sum(sum(s.sibling_accepts) for s in tree.steps)
  assert sibling >= 10, f"ddtree accepted through a rank > 0 sibling only {sibling} times"
  assert sum(sum(s.sibling_accepts) for s in chain.steps) == 0
  print(f"tau ddtree {tree.mean_accepted_length:.2f}, chain {chain.mean_accepted_length:.2f}, sibling accepts {sibling}")
  assert tree.mean_accepted_length > chain.mean_accepted_length + 0.5, (
      tree.mean_accepted_length, chain.mean_accepted_length)


def test_random_drafter_is_lossless_but_rarely_accepted(model, prompts, reference):
  result = decoder(model, make_drafter("random", prompts, reference[0]), "ddtree", (8,), 3).generate(
      prompts, MAX_NEW, stop_token_ids=[])
  check_near_ties(result.tokens, *reference)
  assert result.mean_accepted_length < 1.2


def test_switching_budgets_keeps_tokens_and_acceptance(model, prompts, reference):
  schedule = [8, 0, 0, 4, 8, 0, 1, 8, 4] * 10
  dec = decoder(model, make_drafter("oracle", prompts, reference[0]), "chain", (0, 1, 4, 8), 3)
  result = dec.generate(prompts, MAX_NEW, budget_schedule=lambda i: schedule[i], stop_token_ids=[])
  check_near_ties(result.tokens, *reference)
  assert [s.budget for s in result.steps] == schedule[:len(result.steps)]
  for step in result.steps:  # every step, whatever came before, accepts its whole tree
    assert step.accepted == step.tree_size
    if step.budget == 0:
      assert set(step.accepted) == {1}


# ---- batching and sampling --------------------------------------------------------------------
def test_request_finishing_mid_batch_leaves_others_unchanged(model, prompts, reference):
  dec = decoder(model, make_drafter("noisy", prompts, reference[0]), "ddtree", (8,), 3)
  stop = reference[0][1][3]  # a token that request 1 emits early
  batched = dec.generate(prompts, [MAX_NEW, 5, MAX_NEW], stop_token_ids=[stop])
  for i, prompt in enumerate(prompts):
    alone = dec.generate([prompt], [MAX_NEW, 5, MAX_NEW][i], stop_token_ids=[stop])
    assert batched.tokens[i] == alone.tokens[0]
    assert batched.finish_reasons[i] == alone.finish_reasons[0]
  assert len(batched.tokens[1]) <= 5
  assert batched.tokens[1][-1] == stop or len(batched.tokens[1]) == 5


def seeded_autoregressive(model, prompts, max_new, sampling):
  """Seeded sampling of the target alone, without the engine: prefill, then one token a step, the
  token at absolute position P drawn from the logits of the node at P - 1 with that node's key."""
  batch = len(prompts)
  cache = cache_lib.init_cache(model.cfg, batch, MAX_LEN)
  slots = jnp.arange(batch, dtype=jnp.int32)
  node_positions = np.array([len(p) for p in prompts]) - 1
  decode = jax.jit(fwd.decode_step)
  tokens = []
  with fwd.matmul_precision(model.cfg):
    logits, _, _, cache = fwd.prefill(model, prompts, np.arange(batch), cache, chunk_size=32)
    for _ in range(max_new):
      drawn = verify_lib.draw_tokens(logits[:, None, :], jnp.asarray(node_positions)[:, None], sampling)[:, 0]
      tokens.append(np.asarray(drawn))
      node_positions = node_positions + 1
      logits, _, cache = decode(model, drawn, slots, cache)
  return np.stack(tokens, axis=1).tolist()


def test_seeded_sampling_is_batch_and_budget_invariant(model, prompts, reference):
  """At T > 0 a seeded request's tokens equal seeded sampling of the target alone, whatever the
  batch and the budget, also where the sampled rows accept deep paths and siblings: the drafter
  knows the seeded continuation (with noise), not the greedy one, which a sampled stream leaves at
  its first token (so that drafts were then hardly ever accepted and the T > 0 walk went untested)."""
  kwargs = dict(temperature=[0.8, 1.0, 0.0], top_p=[0.95, 1.0, 1.0], top_k=[0, 20, 0], seed=[11, 12, 13],
                stop_token_ids=[])
  new = 24  # several steps of budget 8, half of MAX_NEW (the reference below decodes token by token)
  sampling = verify_lib.SamplingParams.make(3, **{k: v for k, v in kwargs.items() if k != "stop_token_ids"})
  seeded = seeded_autoregressive(model, prompts, new, sampling)
  assert seeded[0] != reference[0][0][:new]  # sampling actually changed the output
  drafter = drafters.OracleDrafter.make(drafters.greedy_continuations(prompts, seeded), vocab_size=CFG.vocab_size,
                                        max_len=MAX_LEN, noise=0.35)
  dec = decoder(model, drafter, "ddtree", (0, 8), 3)
  # The engine's first token and tree positions key every draw as plain seeded decoding does
  # (a key shared by two positions would still give budget 8 = budget 0 below).
  batched = dec.generate(prompts, new, budget=8, **kwargs)
  assert batched.tokens == seeded
  autoregressive = dec.generate(prompts, new, budget=0, **kwargs)
  siblings = 0
  for row in (0, 1):  # each sampled request alone: its own tokens, accepting drafts (StepStats: per request)
    alone = dec.generate([prompts[row]], new, budget=8, stop_token_ids=[],
                         **{k: kwargs[k][row] for k in ("temperature", "top_p", "top_k", "seed")})
    assert alone.tokens[0] == seeded[row]
    accepted = [a for s in alone.steps for a in s.accepted]
    assert np.mean(accepted) >= 2.0 and max(accepted) >= 4, (row, accepted)
    siblings += sum(sum(s.sibling_accepts) for s in alone.steps)
    print(f"sampled request {row}: accepted lengths {accepted}")
  assert siblings >= 1, siblings
  # Keys depend on (seed, position) only, so speculative sampling reproduces autoregressive sampling.
  assert batched.tokens == autoregressive.tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(budgets=4), "budgets must be a non-empty list of ints >= 0, got 4"),
    (dict(budgets=(4, -1)), "budgets must be a non-empty list"),
    (dict(batch_buckets=2), "batch_buckets must be a non-empty list of ints >= 1, got 2"),
    (dict(batch_buckets=(0,)), "batch_buckets must be"),
    (dict(num_slots=0), "num_slots=0 is smaller than the largest batch bucket 1"),
    (dict(max_len=10), "max_len=10 cannot hold a prompt token, a new token and the verify window of budget 8 "
                       "\\(9 rows\\): it needs at least 11"),
    (dict(max_len=CFG.max_position_embeddings + 10), "past the model's max_position_embeddings"),
    (dict(max_stop_tokens=0), "max_stop_tokens=0 must be an int >= 1"),
])
def test_decoder_settings_are_refused_by_name(model, kwargs, message):
  """Refused before anything compiles, naming the setting."""
  args = dict(budgets=(8,), batch_buckets=(1,), max_len=MAX_LEN, show_progress=False)
  args.update(kwargs)
  with pytest.raises(engine.EngineError, match=message):
    engine.SpeculativeDecoder(model, drafters.RandomDrafter(CFG.vocab_size), **args)


def test_float32_steps_compile_at_full_matmul_precision(model):
  """The GPU's default for float32 products is TF32; a float32 model's steps must not use it (the
  CPU runs float32 either way, so this reads the compiled program)."""
  assert model.cfg.dtype == "float32"
  dec = decoder(model, drafters.RandomDrafter(CFG.vocab_size), "ddtree", (8,), 3)
  # Without the setting only the tree's own exact-count product (``tree.visibility_from_parents``) asks for it.
  full = dec._aux[("step", 3, 8)].as_text().count("operand_precision={highest,highest}")  # pylint: disable=protected-access
  assert full >= 10, full


def test_unseeded_requests_draw_fresh_seeds(model, prompts, reference):
  """Without a seed every request samples on its own (as the server does); equal seeds, equal samples."""
  dec = decoder(model, make_drafter("noisy", prompts, reference[0]), "ddtree", (8,), 3)
  same_prompt = [prompts[1]] * 3
  unseeded = dec.generate(same_prompt, 16, temperature=1.0, stop_token_ids=[]).tokens
  assert len({tuple(t) for t in unseeded}) == 3
  seeded = dec.generate(same_prompt, 16, temperature=1.0, seed=5, stop_token_ids=[]).tokens
  assert seeded[0] == seeded[1] == seeded[2]


def test_jit_and_disable_jit_give_identical_tokens(model, prompts, reference, monkeypatch):
  """Also under the same matmul precision: a float32 model's eager steps run at full precision too
  (the GPU's float32 default, TF32, would part from the compiled steps; the CPU's would not, so
  the setting is checked inside the steps)."""
  drafter = make_drafter("noisy", prompts, reference[0])
  compiled = decoder(model, drafter, "ddtree", (4,), 1).generate([prompts[1]], 10, stop_token_ids=[])
  seen, propose = [], type(drafter).propose

  def spy(self, *args, **kwargs):
    seen.append(jax.config.jax_default_matmul_precision)
    return propose(self, *args, **kwargs)
  monkeypatch.setattr(type(drafter), "propose", spy)
  with jax.disable_jit():
    eager = decoder(model, drafter, "ddtree", (4,), 1, eager=True).generate([prompts[1]], 10, stop_token_ids=[])
  assert model.cfg.dtype == "float32" and seen and set(seen) == {"highest"}, seen
  assert compiled.tokens == eager.tokens
  assert [s.accepted for s in compiled.steps] == [s.accepted for s in eager.steps]
  # Steps that accepted only the root, part of a path and a whole path of budget 4 (5 tokens).
  accepted = [a for s in compiled.steps for a in s.accepted]
  assert 1 in accepted and 5 in accepted and any(1 < a < 5 for a in accepted), accepted


def test_generate_never_compiles_after_warmup(model, prompts, reference):
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
  dec = decoder(model, make_drafter("noisy", prompts, reference[0]), "ddtree", (0, 4, 8), 3)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    dec.generate(prompts, 20, budget=8, temperature=[0.0, 0.7, 1.0], seed=[1, 2, 3], stop_token_ids=[])
    dec.generate([prompts[2], prompts[0]], 9, budget_schedule=lambda i: (0, 4, 8)[i % 3])
    dec.generate([prompts[1][:7]], 5, budget=0)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []


def test_statistics_report_host_share_and_tree_sizes(model, prompts, reference):
  dec = decoder(model, make_drafter("noisy", prompts, reference[0]), "ddtree", (8,), 3)
  result = dec.generate(prompts, 24, stop_token_ids=[])
  assert result.steps and all(s.step_time > 0 and 0 <= s.host_share for s in result.steps)
  assert all(1 <= size <= 9 for s in result.steps for size in s.tree_size)
  assert all(a <= size for s in result.steps for a, size in zip(s.accepted, s.tree_size))
  assert 0 < result.host_share < 1
  assert sum(len(t) for t in result.tokens) == 3 * 24


def test_packed_step_output_unpacks_to_every_field():
  rng = np.random.default_rng(0)
  out = engine.StepOutput(emitted=jnp.asarray(rng.integers(0, 2**31 - 1, (3, 9)), jnp.int32),
                          num_emitted=jnp.asarray([0, 9, 4], jnp.int32), num_accepted=jnp.asarray([0, 8, 3], jnp.int32),
                          tree_size=jnp.asarray([1, 9, 6], jnp.int32), finished=jnp.asarray([False, True, False]),
                          sibling_accepts=jnp.asarray([0, 2, 1], jnp.int32), experts_touched=jnp.asarray(37, jnp.int32))
  packed = jax.jit(engine.pack_output)(out)
  assert packed.shape == (3, 9 + 6) and packed.dtype == jnp.int32
  back = engine.unpack_output(np.asarray(packed))
  for field in ("emitted", "num_emitted", "num_accepted", "tree_size", "sibling_accepts"):
    np.testing.assert_array_equal(getattr(back, field), np.asarray(getattr(out, field)), err_msg=field)
  assert back.finished.dtype == bool and back.finished.tolist() == [False, True, False]
  assert int(back.experts_touched) == 37


def test_each_step_output_is_one_array_whose_copy_starts_at_dispatch(model, prompts, reference, monkeypatch):
  """The host reads a step with one device-to-host copy, started when the step is dispatched (on
  the GPU, asked for only at ``collect`` it cost a batch-1 step 40-50% of its time)."""
  dec = decoder(model, make_drafter("noisy", prompts, reference[0]), "ddtree", (8,), 3)  # the statistics test's
  started, inside = [], []  # copies asked for; the Batch method running (collect's reads ask too)
  array_type = type(jnp.zeros(1))
  original_copy = array_type.copy_to_host_async
  monkeypatch.setattr(array_type, "copy_to_host_async",
                      lambda a: (started.append((inside[-1] if inside else None, a.shape, a.dtype)), original_copy(a))[1])
  for name in ("dispatch", "admit"):
    def traced(self, *args, _name=name, _original=getattr(engine.Batch, name)):
      inside.append(_name)
      try:
        return _original(self, *args)
      finally:
        inside.pop()
    monkeypatch.setattr(engine.Batch, name, traced)
  result = dec.generate(prompts, 24, stop_token_ids=[])
  # One copy a dispatched step: every collected step, plus one dispatched while the last requests
  # finished (nothing to read there).
  at_dispatch = [c for c in started if c[0] == "dispatch"]
  assert set(at_dispatch) == {("dispatch", (3, 9 + 6), np.dtype(np.int32))}
  assert len(result.steps) <= len(at_dispatch) <= len(result.steps) + 1
  # Each admission's first token and its still-active flag, packed into one row (no logprobs here).
  assert [c[1:] for c in started if c[0] == "admit"] == [((1, 2), np.dtype(np.int32))] * len(prompts)


def _aligned(array):
  """``array``'s values in a 64-byte-aligned buffer: jax on the CPU may then share it instead of copying."""
  buffer = np.zeros(array.nbytes + 64, np.uint8)
  offset = (-buffer.ctypes.data) % 64
  out = buffer[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
  out[...] = array
  return out


def test_a_dispatched_step_keeps_its_inputs_when_the_batch_changes(model, prompts, reference):
  """``admit`` and ``_leave`` (cancel, finish) edit the batch's host arrays in place while a step may
  still be queued; the step must keep what it was dispatched with, not alias those arrays."""
  dec = decoder(model, make_drafter("noisy", prompts, reference[0]), "ddtree", (8,), 3)  # the statistics test's
  batch = engine.Batch(dec, 3)
  requests = [dec.request(p, 8, stop_token_ids=[]) for p in prompts[:2]]
  for request in requests:
    batch.admit(request)
  batch.slots, batch.stop_tokens, batch.stop_valid = map(_aligned, (batch.slots, batch.stop_tokens, batch.stop_valid))
  batch.sampling = jax.tree.map(_aligned, batch.sampling)
  batch._device_inputs = None  # pylint: disable=protected-access
  handle = batch.dispatch(8)
  dispatched = batch._device_inputs  # pylint: disable=protected-access  # what the queued step reads
  sent = jax.tree.map(np.array, dispatched)
  assert sent[0][0] == requests[0].slot != dec.pool.scratch_slot
  batch.cancel(requests[0])  # slots[0] becomes the scratch slot, in place
  batch.sampling.temperature[...] = 7.0
  batch.stop_tokens[...] = 5
  batch.stop_valid[...] = True
  assert batch.slots[0] == dec.pool.scratch_slot  # the host arrays did change
  for was, now in zip(jax.tree.leaves(sent), jax.tree.leaves(jax.tree.map(np.array, dispatched))):
    np.testing.assert_array_equal(now, was)
  batch.collect(handle)
  for request in batch.running():
    batch.cancel(request)


def test_more_requests_than_rows_join_as_others_leave(model, prompts, reference):
  """Continuous batching: 3 requests through a bucket of 2 rows, with different lengths."""
  dec = decoder(model, make_drafter("noisy", prompts, reference[0]), "ddtree", (8,), 2)
  limits = [MAX_NEW, 7, MAX_NEW]
  result = dec.generate(prompts, limits, stop_token_ids=[])
  check_near_ties(result.tokens, [r[:n] for r, n in zip(reference[0], limits)], reference[1])
  assert [len(t) for t in result.tokens] == limits and result.finish_reasons == ["length"] * 3
  assert max(len(s.accepted) for s in result.steps) == 2  # never more rows than the bucket
  assert dec.pool.free_slots == dec.num_slots


class FailingDrafter(drafters.RandomDrafter):
  def reset(self, params, state, slot, prompt):
    raise RuntimeError("injected admission failure")


def test_failed_admission_frees_its_slot(model, prompts):
  dec = decoder(model, FailingDrafter(CFG.vocab_size), "ddtree", (8,), 3)  # the random drafter's steps
  with pytest.raises(RuntimeError, match="injected"):
    dec.generate(prompts, 4)
  assert dec.pool.free_slots == dec.num_slots


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_input_names_the_argument(model, prompts, reference):
  drafter = make_drafter("noisy", prompts, reference[0])
  with pytest.raises(ValueError, match="unknown|Unknown"):
    decoder(model, drafter, "no-such-policy", (4,), 1)
  dec = decoder(model, drafter, "ddtree", (0, 4, 8), 3)  # the steps of test_generate_never_compiles_after_warmup
  with pytest.raises(engine.EngineError, match="budget 9 is above the compiled maximum 8"):
    dec.generate([prompts[0]], 4, budget=9)
  with pytest.raises(engine.EngineError, match="budget 2 was not compiled"):
    dec.generate([prompts[0]], 4, budget=2)
  with pytest.raises(engine.EngineError, match="prompt 0 is empty"):
    dec.generate([[]], 4)
  with pytest.raises(engine.EngineError, match="too long for the cache"):
    dec.generate([[5] * 150], 8)
  with pytest.raises(engine.EngineError, match="max_new_tokens must be a positive int"):
    dec.generate([prompts[0]], 0)
  with pytest.raises(ValueError, match="temperature"):
    dec.generate([prompts[0]], 4, temperature=-0.5)
  with pytest.raises(ValueError, match="top_p"):
    dec.generate([prompts[0]], 4, temperature=1.0, top_p=1.5)
  with pytest.raises(ValueError, match="top_p"):
    dec.generate([prompts[0]], 4, temperature=1.0, top_p=0.0)
  with pytest.raises(engine.EngineError, match="outside \\[0, 256\\)"):
    dec.generate([[1, 999]], 4)
  with pytest.raises(engine.EngineError, match="stop_token_ids must be a list"):
    dec.generate([prompts[0]], 4, stop_token_ids=5)
  with pytest.raises(engine.EngineError, match="budget must be an int"):
    dec.generate([prompts[0]], 4, budget="4")
  with pytest.raises(engine.EngineError, match="prompt 0 must be a flat list"):
    dec.generate([[1, [2, 3]]], 4)
  with pytest.raises(engine.EngineError, match="stop token ids must be ints, got 'a'"):
    dec.generate([prompts[0]], 4, stop_token_ids=["a"])
  assert dec.generate(np.asarray([prompts[0][:4]]), 4).tokens  # equal-length prompts as a 2-D array
  with pytest.raises(engine.EngineError, match="no free row: all 3 rows"):
    batch = engine.Batch(dec, 3)
    for i in range(4):
      batch.admit(dec.request(prompts[i % 3], 4))
  for request in batch.running():
    batch.cancel(request)
  with pytest.raises(engine.EngineError, match="batch bucket 2 was not compiled \\(compiled buckets: \\[3\\]\\)"):
    engine.Batch(dec, 2)
  # The engine still serves after refusing bad requests, and every slot is free again.
  assert dec.generate([prompts[0]], 4).tokens
  assert dec.pool.free_slots == dec.num_slots


@pytest.mark.slow
def test_every_budget_from_1_to_64_compiles_and_is_lossless(model, prompts, reference):
  """DESIGN §3.1: buffers sized for one budget broke others; here every budget is its own shape."""
  budgets = tuple(range(1, 65))
  dec = decoder(model, make_drafter("noisy", prompts, reference[0]), "ddtree", budgets, 3)
  for budget in budgets:
    result = dec.generate(prompts, MAX_NEW, budget=budget, stop_token_ids=[])
    check_near_ties(result.tokens, *reference, context=f"ddtree/budget {budget}")


# ---- the server's batch operations: cancel and resize --------------------------------------------
def test_cancel_and_resize_keep_other_requests_lossless(model, prompts, reference):
  """A request cancelled while a step that computes it is in flight frees its slot at once; a new
  request takes that slot before the old step is read, and it and the others, moved between
  buckets, still decode exactly the greedy reference."""
  dec = engine.SpeculativeDecoder(model, make_drafter("noisy", prompts, reference[0]), policy="ddtree",
                                  budgets=(8,), batch_buckets=(2, 4), max_len=MAX_LEN, show_progress=False)
  make = lambda i, n=MAX_NEW: dec.request(prompts[i], n, stop_token_ids=[])
  batch = engine.Batch(dec, 4)
  first = [make(0), make(1), make(2)]
  for r in first:
    batch.admit(r)
  pending = batch.dispatch(8)
  pending, previous = batch.dispatch(8), pending
  batch.collect(previous)
  cancelled_slot = first[1].slot
  batch.cancel(first[1])  # the step in `pending` still computes it
  assert first[1].finish_reason == "cancelled" and dec.pool.free_slots == dec.num_slots - 2
  assert np.asarray(batch.decode.active).tolist() == [True, False, True, False]  # stopped on the device
  late = make(1, 20)
  batch.admit(late)  # reuses the slot and the row while the old step is still unread
  assert late.slot == cancelled_slot and batch.rows[1] is late
  resized = []
  while batch.num_running or pending is not None:
    dispatched = batch.dispatch(8) if batch.num_running else None
    if pending is not None:
      batch.collect(pending)
    pending = dispatched
    if not resized and batch.num_running and batch.num_running <= 2:
      batch.resize(2)  # shrink while a step is in flight
      resized.append(2)
    elif resized == [2] and batch.bucket == 2 and batch.num_running:
      batch.resize(4)  # and grow back
      resized.append(4)
  assert resized == [2, 4]
  assert all(r.finished for r in first + [late])
  cancelled = first[1].tokens
  assert cancelled == reference[0][1][:len(cancelled)] and len(cancelled) < MAX_NEW
  check_near_ties([first[0].tokens, first[2].tokens, late.tokens],
                  [reference[0][0], reference[0][2], reference[0][1][:20]],
                  [reference[1][0], reference[1][2], reference[1][1]], context="cancel/resize")
  assert dec.pool.free_slots == dec.num_slots
