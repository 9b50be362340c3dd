"""What the engine takes from a tree policy: its choice of nodes, nothing else (tiny target, float32, CPU).

A custom policy may get every derived field of its ``Tree`` wrong (visibility, positions, depth,
the root token), point parents forward or at padding, or go deeper than ``max_depth``: the engine
rebuilds the tree from tokens, parents and valid (``tree.canonical_tree``), so the output stays
identical to greedy decoding and, where the corrupted tree chose the same nodes as ``chain``, the
steps accept exactly what ``chain``'s do. A tree of the wrong type, shape or dtype is refused when
the step compiles, with an ``EngineError`` naming the policy.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import drafters, engine, policies
from ddtree_jax.near_tie import check_near_ties, greedy_reference
from models import kimi
from models.config import KimiConfig

CFG = KimiConfig.tiny()
MAX_NEW, MAX_LEN, BUDGET = 24, 96, 6


@pytest.fixture(scope="module")
def setup():
  model = kimi.init_model(CFG, seed=0)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (5, 11)]
  reference = greedy_reference(model, prompts, MAX_NEW, MAX_LEN)
  drafter = drafters.OracleDrafter.make(drafters.greedy_continuations(prompts, reference[0]),
                                        vocab_size=CFG.vocab_size, max_len=MAX_LEN)
  return model, prompts, reference, drafter


def run(setup, policy, **kwargs):
  model, prompts, reference, drafter = setup
  dec = engine.SpeculativeDecoder(model, drafter, policy=policy, budgets=(BUDGET,), batch_buckets=(2,),
                                  max_len=MAX_LEN, show_progress=False, **kwargs)
  result = dec.generate(prompts, MAX_NEW, stop_token_ids=[])
  check_near_ties(result.tokens, *reference, dtype="float32", context=getattr(policy, "__name__", policy))
  return result


def corrupted(mutate):
  def policy(root_tokens, start, ids, logprobs, budget, max_depth=None):
    return mutate(policies.chain(root_tokens, start, ids, logprobs, budget, max_depth))
  policy.__name__ = mutate.__name__
  return policy


def root_self_visibility(t):
  q = t.q_len
  eye = jnp.eye(q, dtype=bool)[None]
  return dataclasses.replace(t, visibility=eye | (jnp.arange(q)[None, None, :] == 0))


def shifted_positions(t):
  return dataclasses.replace(t, positions=t.positions + 1)


def other_root_token(t):
  return dataclasses.replace(t, tokens=t.tokens.at[:, 0].set((t.tokens[:, 0] + 1) % CFG.vocab_size))


@pytest.fixture(scope="module")
def clean(setup):
  return run(setup, "chain")


def all_three(t):
  return other_root_token(shifted_positions(root_self_visibility(t)))


# (Depth and padded rows' fields are rebuilt too: tests/ddtree_jax/test_tree.py checks every field.)
# The default run corrupts all three fields in one policy (one compiled step); each alone, which
# names the field that leaked, runs under -m slow.
@pytest.mark.parametrize("mutate", [all_three] + [pytest.param(m, marks=pytest.mark.slow) for m in (
    root_self_visibility, shifted_positions, other_root_token)], ids=lambda f: f.__name__)
def test_derived_fields_of_a_policy_tree_cannot_change_the_output(setup, clean, mutate):
  got = run(setup, corrupted(mutate))
  assert got.tokens == clean.tokens
  assert [s.accepted for s in got.steps] == [s.accepted for s in clean.steps]
  assert [s.tree_size for s in got.steps] == [s.tree_size for s in clean.steps]
  assert clean.mean_accepted_length > 4  # a noise-free oracle: whole chains accepted


def cut_by_bad_parents(t):
  # Node 3 points forward, node 5 at itself: both, and what hangs below them, are not verified.
  parents = t.parents.at[:, 3].set(5).at[:, 5].set(5)
  return dataclasses.replace(t, parents=parents)


def test_malformed_parents_are_cut_not_verified(setup):
  # (max_depth caps and padded ancestors: tests/ddtree_jax/test_tree.py, field by field.)
  got = run(setup, corrupted(cut_by_bad_parents))
  # The chain keeps nodes 0..2 only: 3 accepted a step at most.
  assert max(a for s in got.steps for a in s.accepted) == 3
  assert max(n for s in got.steps for n in s.tree_size) == 3


@pytest.mark.parametrize("token", [CFG.vocab_size, -1])
def test_a_token_outside_the_vocabulary_is_never_verified(setup, clean, token):
  """Such a node can never be accepted; verified, it would enter the target's embedding as NaN
  (or wrap around) and reach the other nodes of the window through the attention."""
  def with_extra_child(t):
    extra = t.valid.shape[1] - 1  # the last row, padding in a chain shorter than the budget
    return dataclasses.replace(t, tokens=t.tokens.at[:, extra].set(token), parents=t.parents.at[:, extra].set(0),
                               valid=t.valid.at[:, extra].set(True))

  def chain_short(root_tokens, start, ids, logprobs, budget, max_depth=None):
    tree = policies.chain(root_tokens, start, ids, logprobs, budget, jnp.minimum(max_depth, budget - 1))
    return with_extra_child(tree)
  got = run(setup, chain_short)
  assert max(n for s in got.steps for n in s.tree_size) == BUDGET  # the chain's nodes, not the extra one


def test_a_policy_that_raises_is_named(setup):
  def broken(root_tokens, start, ids, logprobs, budget, max_depth=None):
    return [][0]
  with pytest.raises(engine.EngineError, match="policy 'broken' failed at budget 6: IndexError: list index"):
    run(setup, broken)


def test_policy_options_are_bound_to_a_callable(setup):
  def capped_chain(root_tokens, start, ids, logprobs, budget, max_depth=None, cap=BUDGET):
    return policies.chain(root_tokens, start, ids, logprobs, budget, jnp.minimum(max_depth, cap))
  got = run(setup, capped_chain, policy_options={"cap": 2})
  assert max(n for s in got.steps for n in s.tree_size) == 3
  with pytest.raises(engine.EngineError, match="'capped_chain' got unknown options \\['floor'\\]; it accepts \\['cap'\\]"):
    run(setup, capped_chain, policy_options={"floor": 0.1})


def as_tuple(t):
  return (t.tokens, t.parents, t.valid)


def one_row_more(t):
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)))
  return dataclasses.replace(t, tokens=pad(t.tokens), parents=pad(t.parents) - 1, valid=pad(t.valid))


def float_parents(t):
  return dataclasses.replace(t, parents=t.parents.astype(jnp.float32))


def int_valid(t):
  return dataclasses.replace(t, valid=t.valid.astype(jnp.int32))


def int8_tokens(t):  # token ids would wrap: nothing accepted, silently
  return dataclasses.replace(t, tokens=t.tokens.astype(jnp.int8))


@pytest.mark.parametrize("mutate, message", [
    (as_tuple, "policy 'as_tuple' returned tuple, not a tree.Tree"),
    (one_row_more, "policy 'one_row_more' returned tokens of shape \\(2, 8\\) at budget 6; a tree has "
                   "\\[batch, budget \\+ 1\\] = \\[2, 7\\]"),
    (float_parents, "policy 'float_parents' returned parents of dtype float32; expected int32"),
    (int8_tokens, "policy 'int8_tokens' returned tokens of dtype int8; expected int32 \\(or another integer of 32"),
    (int_valid, "policy 'int_valid' returned valid of dtype int32; expected bool"),
], ids=lambda x: getattr(x, "__name__", "message"))
def test_a_malformed_tree_is_refused_naming_the_policy(setup, mutate, message):
  with pytest.raises(engine.EngineError, match=message):
    run(setup, corrupted(mutate))


def test_policy_must_be_a_name_or_callable(setup):
  with pytest.raises(engine.EngineError, match="policy must be a registered name or a callable"):
    run(setup, 42)
