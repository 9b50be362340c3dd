"""Tree policies against host references (float32 log-probs, int32 tokens; CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import policies as P
from ddtree_jax import tree as T
from models import ordering

N_LEVELS, TOP_K, VOCAB = 15, 64, 500
KINDS = ("normal", "quantised", "peaked", "flat", "dupes", "decimal")


def _logprobs(rng, kind, n_levels=N_LEVELS, k=TOP_K):
  """float32[L, k] sorted descending; every kind but "normal" is built to produce exact ties."""
  logits = rng.normal(size=(n_levels, VOCAB)).astype(np.float32) * rng.uniform(0.5, 4.0)
  lp = -np.sort(-np.asarray(jax.nn.log_softmax(logits, -1)), -1)[:, :k]
  if kind == "quantised":
    lp = np.minimum(np.round(lp * 2.0) / 2.0, 0.0)
  elif kind == "peaked":
    # A child at a certain position ties its parent exactly.
    peaked = rng.random(n_levels) < 0.5
    lp[peaked, 0] = 0.0
  elif kind == "flat":
    lp[:] = np.float32(-1.25)
  elif kind == "dupes":
    lp[:, 1::2] = lp[:, 0::2]
    lp[:, 3::4] = lp[:, 2::4]
  elif kind == "decimal":
    # Sums of non-dyadic values that are equal in exact arithmetic round apart in float32 (and
    # differently in float64), so only parent-first float32 accumulation matches everywhere.
    lp = -np.sort(rng.integers(1, 30, (n_levels, k)).astype(np.float32) / np.float32(10), -1)
  return np.ascontiguousarray(lp, np.float32)


def _ids(rng, batch, n_levels=N_LEVELS, k=TOP_K):
  """Distinct random tokens per position (0 included), so token paths identify rank paths."""
  return np.argsort(rng.random((batch, n_levels, VOCAB)), -1)[..., :k].astype(np.int32)


def _token_paths(ids_row, rank_paths):
  return [tuple(int(ids_row[d, r]) for d, r in enumerate(p)) for p in rank_paths]


def _check_structure(tree, start, budget):
  """Every Tree invariant a policy promises, checked on host."""
  tokens, parents, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
  assert tokens.shape == (len(start), budget + 1)
  # Numpy inputs run the host validation: root, parents first, prefix-closed, distinct siblings.
  ref = T.tree_from_parents(tokens, parents, valid, np.asarray(start, np.int32))
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(tree.positions, np.asarray(start)[:, None] + np.asarray(tree.depth))
  assert (parents[~valid] == -1).all() and (np.asarray(tree.depth)[~valid] == 0).all()


@functools.cache
def _jitted(policy, budget, options):
  # One executable per (policy, options, budget) across tests keeps CPU compile time down.
  return jax.jit(functools.partial(P.get_policy(policy, **dict(options)), budget=budget))


def _call(policy, budget, ids, lp, max_depth=None, **options):
  batch = ids.shape[0]
  root = jnp.arange(batch, dtype=jnp.int32) + 7
  start = jnp.arange(batch, dtype=jnp.int32) * 3
  tree = _jitted(policy, budget, tuple(sorted(options.items())))(root, start, ids, lp,
                                                                 max_depth=max_depth)
  _check_structure(tree, start, budget)
  np.testing.assert_array_equal(tree.tokens[:, 0], root)
  return tree


@pytest.mark.parametrize("budget", [1, 2, 7, 16, 31, 64] + [
    pytest.param(b, marks=pytest.mark.slow) for b in (3, 4, 8, 15, 32, 63)])
def test_ddtree_matches_heap_reference(budget):
  rng = np.random.default_rng(budget)
  kinds = KINDS * 3
  lp = np.stack([_logprobs(rng, kind) for kind in kinds])
  ids = _ids(rng, len(kinds))
  # Uncapped, tight and degenerate depth caps, each kind with several.
  caps = np.array([N_LEVELS] * 6 + [0, 1, 2, 3, 5, 8] + list(rng.integers(1, N_LEVELS + 1, 6)),
                  np.int32)
  tree = _call("ddtree", budget, ids, lp, max_depth=caps)
  paths = T.tree_to_paths(tree)
  for b in range(len(kinds)):
    ref = P.ddtree_heap_reference(lp[b], budget, caps[b])
    assert paths[b] == _token_paths(ids[b], ref), (kinds[b], caps[b])
    # Nodes fill the leading rows in emission order; padding only after them.
    np.testing.assert_array_equal(tree.valid[b], np.arange(budget + 1) <= len(ref))
    # k >= budget, so any cap >= 1 leaves enough candidates to fill the budget.
    assert len(ref) == (budget if caps[b] > 0 else 0)


@pytest.mark.parametrize("policy", ["ddtree", "beam"])
def test_log_probs_just_above_zero_keep_the_tree_prefix_closed(policy):
  """A confident drafter's top log-prob can round just above 0 (bf16 log_softmax, an epsilon
  floor). Scores then grow with depth; before clamping, the device search picked the deepest
  chain nodes without their ancestors (seen as a never-accepted exact oracle)."""
  rng = np.random.default_rng(4)
  budget = 8
  lp = np.stack([_logprobs(rng, "peaked") for _ in range(2)])
  lp[:, :, 0] = np.float32(1e-6)  # every top candidate "certain", just above 0
  ids = _ids(rng, 2)
  start = np.array([3, 11], np.int32)
  tree = P.get_policy(policy)(jnp.asarray(ids[:, 0, 0]), jnp.asarray(start), jnp.asarray(ids),
                              jnp.asarray(lp), budget=budget)
  _check_structure(tree, start, budget)
  # The certain chain comes first: depth 1..budget along rank 0.
  np.testing.assert_array_equal(np.asarray(tree.depth)[:, 1:budget + 1], np.tile(np.arange(1, budget + 1), (2, 1)))
  if policy == "ddtree":
    for b in range(2):
      ref = P.ddtree_heap_reference(lp[b], budget)
      assert ref == [(0,) * d for d in range(1, budget + 1)]


def test_ddtree_ties_follow_depth_then_rank_order():
  """Hand-checked order on exact ties: score, then shallower first, then lexicographic ranks."""
  lp = np.full((3, 8), -9.0, np.float32)
  lp[:, :3] = [[0.0, -1.0, -1.0], [0.0, -1.0, -2.0], [-1.0, -1.0, -3.0]]
  ref = P.ddtree_heap_reference(lp, 8)
  assert ref == [(0,), (0, 0), (1,), (2,), (0, 1), (1, 0), (2, 0), (0, 0, 0)]
  ids = np.arange(24, dtype=np.int32).reshape(1, 3, 8)
  tree = _call("ddtree", 8, ids, lp[None])
  assert T.tree_to_paths(tree)[0] == _token_paths(ids[0], ref)


def test_ddtree_jit_equals_eager():
  rng = np.random.default_rng(11)
  lp = np.stack([_logprobs(rng, kind, n_levels=6, k=8) for kind in ("normal", "peaked", "decimal")])
  ids = _ids(rng, 3, n_levels=6, k=8)
  args = (jnp.array([1, 2, 3]), jnp.array([0, 5, 9]), ids, lp)
  caps = jnp.array([6, 1, 0], jnp.int32)
  jitted = jax.jit(P.ddtree, static_argnames="budget")(*args, budget=8, max_depth=caps)
  with jax.disable_jit():
    eager = P.ddtree(*args, budget=8, max_depth=caps)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(a, b)
  # Depth cap 1 leaves all 8 top-1 candidates; cap 0 leaves the root alone.
  assert np.asarray(jitted.valid).sum(1).tolist() == [9, 9, 1]


def test_ddtree_looped_level_scan_equals_the_unrolled_one(monkeypatch):
  """``benchmarks/level_unroll.py`` times the two forms of the layered search; they must be one
  function."""
  rng = np.random.default_rng(12)
  kinds = ("normal", "peaked", "decimal", "flat")
  lp = np.stack([_logprobs(rng, kind, n_levels=6, k=12) for kind in kinds])
  args = (jnp.arange(4), jnp.array([0, 5, 9, 2]), _ids(rng, 4, n_levels=6, k=12), lp)
  caps = jnp.array([6, 3, 1, 0], jnp.int32)
  trees = []
  for unroll in (True, 1):
    monkeypatch.setattr(P, "LEVEL_SCAN_UNROLL", unroll)
    trees.append(jax.jit(lambda *a: P.ddtree(*a, budget=12, max_depth=caps))(*args))  # a fresh trace each
  for a, b in zip(jax.tree.leaves(trees[0]), jax.tree.leaves(trees[1])):
    np.testing.assert_array_equal(a, b)
  assert np.asarray(trees[0].valid).sum(1).tolist()[2:] == [13, 1]  # cap 1: 12 of the depth-1 candidates


def _pairwise_everywhere(n, max_pairwise, pairwise, sort):
  del n, max_pairwise, sort
  return pairwise()


# ddtree at budget 16 by default (the GPU's sizes); a small budget and beam (the same search) under -m slow.
@pytest.mark.parametrize("policy, budget, options", [
    pytest.param("ddtree", 7, {}, marks=pytest.mark.slow), ("ddtree", 16, {}),
    pytest.param("beam", 15, {"width": 3}, marks=pytest.mark.slow)])
def test_search_on_pairwise_ranks_builds_the_sorted_searchs_trees(monkeypatch, policy, budget, options):
  """The layered search with every ordering sort-free (as on the GPU, here at every size) builds
  the trees of the CPU's sorted search, which the tests above hold to the host references."""
  rng = np.random.default_rng(budget)
  lp = np.stack([_logprobs(rng, kind) for kind in KINDS * 2])
  ids = _ids(rng, len(lp))
  caps = jnp.asarray(np.array([N_LEVELS] * 6 + [0, 1, 2, 3, 5, 8], np.int32))
  args = (jnp.arange(len(lp), dtype=jnp.int32), jnp.arange(len(lp), dtype=jnp.int32) * 2, ids, lp)
  # A new function for each trace: jax caches traces by the function.
  call = lambda: lambda *a: P.get_policy(policy, **options)(*a, budget=budget, max_depth=caps)
  sorted_tree = jax.jit(call())(*args)
  assert " sort[" in str(jax.make_jaxpr(call())(*args))
  monkeypatch.setattr(ordering, "_pairwise_on_gpu", _pairwise_everywhere)
  pairwise_tree = jax.jit(call())(*args)
  assert " sort[" not in str(jax.make_jaxpr(call())(*args))
  for a, b in zip(jax.tree.leaves(pairwise_tree), jax.tree.leaves(sorted_tree)):
    np.testing.assert_array_equal(a, b)
  assert np.asarray(sorted_tree.valid).sum() > len(lp) * 2  # real trees, not roots alone


def test_sort_free_ordering_is_chosen_for_cuda_up_to_its_size(monkeypatch):
  """Lowered for CUDA, the search has no sort where every set is small (budget 16: 256
  candidates a depth) and keeps ``lax.sort`` past ``RANK_SELECT_MAX`` (budget 64: 4096), or at
  every size where it is 0 (``benchmarks/search_ordering.py``'s baseline)."""
  def lowered(budget):
    shapes = (jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32),
              jax.ShapeDtypeStruct((2, 4, budget), jnp.int32), jax.ShapeDtypeStruct((2, 4, budget), jnp.float32))
    fn = jax.jit(functools.partial(P.ddtree, budget=budget))
    return fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.sort" not in lowered(16)
  assert "stablehlo.sort" in lowered(64)
  assert 16 * 16 <= P.RANK_SELECT_MAX < 64 * 64
  monkeypatch.setattr(P, "RANK_SELECT_MAX", 0)
  assert "stablehlo.sort" in lowered(16)


@pytest.mark.parametrize("policy", ["ddtree", "beam", "chain", "static"])
def test_budget_zero_is_root_only(policy):
  rng = np.random.default_rng(0)
  tree = _call(policy, 0, _ids(rng, 2, k=8), np.stack([_logprobs(rng, "normal", k=8)] * 2))
  assert tree.q_len == 1 and np.asarray(tree.valid).all()


def test_chain_is_argmax_path():
  rng = np.random.default_rng(5)
  ids, lp = _ids(rng, 3, k=4), np.stack([_logprobs(rng, "normal", k=4) for _ in range(3)])
  caps = np.array([15, 6, 0], np.int32)
  for budget in (4, 20):
    tree = _call("chain", budget, ids, lp, max_depth=caps)
    for b, path in enumerate(T.tree_to_paths(tree)):
      n = min(budget, N_LEVELS, caps[b])
      assert path == [tuple(ids[b, :d + 1, 0]) for d in range(n)]
      np.testing.assert_array_equal(tree.valid[b], np.arange(budget + 1) <= n)


def _beam_reference(lp, budget, width, cap):
  """EAGLE-2 beam on host: per depth expand the kept nodes, keep the best ``width``, rerank all."""
  kept, pool = [((), np.float32(0.0))], []
  for d in range(min(lp.shape[0], cap)):
    cands = [(path + (r,), np.float32(s + lp[d, r]))
             for path, s in kept for r in range(min(width, lp.shape[1]))]
    cands.sort(key=lambda c: (-float(c[1]), c[0]))
    kept, pool = cands[:width], pool + cands
  pool.sort(key=lambda c: (-float(c[1]), len(c[0]), c[0]))
  return [p for p, _ in pool[:budget]]


@pytest.mark.parametrize("budget, width", [(8, 2), (15, 3), (3, 5)] + [
    pytest.param(b, w, marks=pytest.mark.slow) for b, w in ((16, 4), (32, 6))])
def test_beam_matches_host_reference(budget, width):
  rng = np.random.default_rng(budget * 10 + width)
  lp = np.stack([_logprobs(rng, kind, k=8) for kind in KINDS * 2])
  ids = _ids(rng, len(lp), k=8)
  caps = np.array([15] * 6 + [1, 2, 3, 6, 9, 0], np.int32)
  tree = _call("beam", budget, ids, lp, max_depth=caps, width=width)
  for b, path in enumerate(T.tree_to_paths(tree)):
    assert path == _token_paths(ids[b], _beam_reference(lp[b], budget, width, caps[b]))


@pytest.mark.parametrize("budget", [16, pytest.param(4, marks=pytest.mark.slow)])
def test_wide_beam_equals_ddtree(budget):
  rng = np.random.default_rng(budget + 100)
  kinds = KINDS * 3
  lp = np.stack([_logprobs(rng, kind) for kind in kinds])
  ids = _ids(rng, len(kinds))
  caps = np.array([N_LEVELS] * 12 + [3, 1, 0, 2, 7, 5], np.int32)
  wide = _call("beam", budget, ids, lp, max_depth=caps, width=budget)
  best = _call("ddtree", budget, ids, lp, max_depth=caps)
  for a, b in zip(jax.tree.leaves(wide), jax.tree.leaves(best)):
    np.testing.assert_array_equal(a, b)
  narrow = _call("beam", budget, ids, lp, max_depth=caps, width=1)
  chain = _call("chain", budget, ids, lp, max_depth=caps)
  assert T.tree_to_paths(narrow) == T.tree_to_paths(chain)


def test_static_reproduces_rank_paths():
  rank_paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (2,), (0, 0, 0), (1, 0, 3)]
  rng = np.random.default_rng(6)
  ids = _ids(rng, 3, n_levels=4, k=4)
  lp = np.stack([_logprobs(rng, "normal", n_levels=4, k=4)] * 3)
  caps = np.array([4, 1, 2], np.int32)
  rank_paths = tuple(rank_paths)
  tree = _call("static", 6, ids, lp, max_depth=caps, rank_paths=rank_paths)
  paths = T.tree_to_paths(tree)
  assert paths[0] == _token_paths(ids[0], rank_paths[:6])
  # Deeper paths are skipped before truncation, so the budget goes to allowed depths.
  assert paths[1] == _token_paths(ids[1], [(0,), (1,), (2,)])
  assert paths[2] == _token_paths(ids[2], [p for p in rank_paths if len(p) <= 2])
  full = _call("static", 8, ids, lp, rank_paths=rank_paths)
  assert T.tree_to_paths(full)[0] == _token_paths(ids[0], rank_paths)


def test_default_rank_paths():
  paths = P.DEFAULT_RANK_PATHS
  assert len(paths) >= 64 and len(set(paths)) == len(paths)
  assert paths == P.prior_rank_paths()
  seen = set()
  for path in paths:
    assert len(path) == 1 or path[:-1] in seen
    seen.add(path)
  # The prior favours the argmax chain but still branches.
  assert paths[0] == (0,) and (1,) in paths and max(len(p) for p in paths) == N_LEVELS
  rng = np.random.default_rng(7)
  ids, lp = _ids(rng, 2, k=8), np.stack([_logprobs(rng, "normal", k=8)] * 2)
  tree = _call("static", 64, ids, lp, max_depth=np.array([15, 3], np.int32))
  paths_out = T.tree_to_paths(tree)
  assert paths_out[0] == _token_paths(ids[0], paths[:64])
  assert paths_out[1] == _token_paths(ids[1], [p for p in paths if len(p) <= 3][:64])


def test_prior_rank_paths_reach_every_rank_a_flat_prior_uses():
  """The DDTree of the rank prior for any top1, against the heap reference over every rank: with a
  flat prior (small top1) far ranks beat deep paths (a cut at 8 ranks gave another tree)."""
  for top1, num_paths, depth in ((0.3, 40, 2), (0.5, 128, 3), (0.8, 64, 4)):
    rows = np.broadcast_to(np.log(top1 * (1 - top1) ** np.arange(num_paths)).astype(np.float32), (depth, num_paths))
    want = tuple(P.ddtree_heap_reference(rows, num_paths))
    assert P.prior_rank_paths(top1=top1, num_paths=num_paths, max_depth=depth) == want
  assert max(r for path in P.prior_rank_paths(top1=0.3, num_paths=40, max_depth=2) for r in path) >= 8


def test_registry():
  assert {"ddtree", "beam", "chain", "static"} <= set(P.available_policies())
  with pytest.raises(ValueError, match="unknown policy 'nope'.*ddtree"):
    P.get_policy("nope")
  with pytest.raises(ValueError, match="unknown options.*'widht'.*width"):
    P.get_policy("beam", widht=3)
  with pytest.raises(ValueError, match="policy 'ddtree' is already registered \\(by ddtree_jax.policies.ddtree\\); "
                                       "pass replace=True"):
    P.register_policy("ddtree")(P.chain)
  with pytest.raises(TypeError, match="takes the policy's name first, as @register_policy\\('name'\\)"):
    P.register_policy(P.chain)


def test_reregistering_the_same_definition_replaces_it(monkeypatch):
  """A notebook cell run again after an edit re-registers its policy; another function under a
  taken name needs replace=True."""
  monkeypatch.setattr(P, "_POLICIES", dict(P._POLICIES))
  first = lambda **kw: "first"  # one qualified name per definition site, like a re-run cell
  second = lambda **kw: "second"
  for value in (first, second):
    value.__qualname__ = "cell_policy"
    P.register_policy("cell_policy")(value)
  assert P.get_policy("cell_policy")() == "second"

  def other(root_tokens, start, ids, logprobs, budget, max_depth=None):
    return "other"
  with pytest.raises(ValueError, match="already registered"):
    P.register_policy("cell_policy")(other)
  P.register_policy("cell_policy", replace=True)(other)
  assert P.get_policy("cell_policy")(None, None, None, None, 0) == "other"
  # Partials (and other callables without a qualified name) are never "the same definition".
  P.register_policy("wide_beam")(functools.partial(P.beam, width=2))
  with pytest.raises(ValueError, match="'wide_beam' is already registered"):
    P.register_policy("wide_beam")(functools.partial(P.beam, width=8))
  assert P.get_policy("wide_beam").keywords == {"width": 2}


def test_register_custom_policy(monkeypatch):
  monkeypatch.setattr(P, "_POLICIES", dict(P._POLICIES))

  @P.register_policy("first_rank_chain")
  def first_rank_chain(root_tokens, start, ids, logprobs, budget, max_depth=None):
    return P.chain(root_tokens, start, ids, logprobs, budget, max_depth)

  assert "first_rank_chain" in P.available_policies()
  rng = np.random.default_rng(8)
  ids, lp = _ids(rng, 1, k=2), _logprobs(rng, "normal", k=2)[None]
  tree = _call("first_rank_chain", 3, ids, lp)
  assert T.tree_to_paths(tree)[0] == [tuple(ids[0, :d, 0]) for d in (1, 2, 3)]


@pytest.mark.parametrize("policy, options, budget, k, message", [
    ("ddtree", {}, 8, 4, "budget=8.*k=4"),
    ("beam", {"width": 4}, 8, 3, "budget=8.*k=3"),
    ("static", {"rank_paths": [(0,), (5,)]}, 2, 4, "budget=2.*k=4"),
    ("ddtree", {}, -1, 4, "budget must be"),
    ("chain", {}, 2.0, 4, "budget must be"),
    ("beam", {"width": 0}, 2, 4, "width"),
    ("static", {"rank_paths": [(0, 0), (0,)]}, 2, 4, "before its parent"),
    ("static", {"rank_paths": [(0,), (0,)]}, 2, 4, "twice"),
    ("static", {"rank_paths": [(0,), ()]}, 2, 4, "non-empty"),
])
def test_bad_inputs(policy, options, budget, k, message):
  ids = jnp.zeros((1, 3, k), jnp.int32)
  lp = jnp.zeros((1, 3, k), jnp.float32)
  with pytest.raises(ValueError, match=message):
    P.get_policy(policy, **options)(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), ids, lp,
                                    budget)


@pytest.mark.parametrize("policy", ["ddtree", "beam", "chain", "static"])
def test_per_request_arguments_must_have_one_entry_per_request(policy):
  ids, lp = jnp.zeros((2, 3, 4), jnp.int32), jnp.zeros((2, 3, 4), jnp.float32)
  ok = dict(root_tokens=jnp.zeros(2, jnp.int32), start=jnp.zeros(2, jnp.int32), max_depth=jnp.full(2, 3, jnp.int32))
  fn = P.get_policy(policy)
  fn(ids=ids, logprobs=lp, budget=2, **ok)
  for arg, bad in (("root_tokens", jnp.zeros(3, jnp.int32)), ("start", jnp.zeros((2, 1), jnp.int32)),
                   ("max_depth", jnp.int32(3))):
    with pytest.raises(ValueError, match=f"{policy}: {arg} must be \\[B\\] = \\[2\\]"):
      fn(ids=ids, logprobs=lp, budget=2, **{**ok, arg: bad})


def test_static_needs_only_reachable_ranks():
  # Rank 5 sits past the budget under every depth cap, so k = 4 is enough.
  rank_paths = ((0,), (0, 0), (1,), (2,), (5,))
  ids = jnp.arange(12, dtype=jnp.int32).reshape(1, 3, 4)
  tree = _call("static", 3, ids, jnp.zeros((1, 3, 4)), rank_paths=rank_paths)
  assert T.tree_to_paths(tree)[0] == [(0,), (0, 4), (1,)]
  capped = _call("static", 3, ids, jnp.zeros((1, 3, 4)), max_depth=jnp.array([1]),
                 rank_paths=rank_paths)
  assert T.tree_to_paths(capped)[0] == [(0,), (1,), (2,)]
