"""Tree flattening helpers against dense host references (bool masks, int32 indices; CPU)."""

import jax
import numpy as np
import pytest

from ddtree_jax import tree as T


def _random_trees(rng, batch, q_len, keep=0.8):
  """Random parent-first trees with tree-prefix-closed padding and distinct tokens."""
  parents = np.full((batch, q_len), -1, np.int32)
  valid = np.zeros((batch, q_len), bool)
  valid[:, 0] = True
  for b in range(batch):
    for i in range(1, q_len):
      parents[b, i] = rng.integers(0, i)
      valid[b, i] = valid[b, parents[b, i]] and rng.random() < keep
  tokens = np.stack([rng.permutation(10 * q_len)[:q_len] for _ in range(batch)]).astype(np.int32)
  # Token 0 appears as a real token in some rows: padding must never be read from tokens.
  tokens[0, 0] = 0
  return tokens, parents, valid


def _dense_visibility(parents, valid):
  batch, q_len = parents.shape
  vis = np.zeros((batch, q_len, q_len), bool)
  for b in range(batch):
    for i in range(q_len):
      vis[b, i, i] = True
      j = parents[b, i]
      while valid[b, i] and j >= 0:
        vis[b, i, j] = True
        j = parents[b, j]
  return vis


@pytest.mark.parametrize("q_len", [1, 2, 3, 9, 33, 65])
def test_visibility_and_depth_match_dense_reference(q_len):
  rng = np.random.default_rng(q_len)
  tokens, parents, valid = _random_trees(rng, 6, q_len)
  # Garbage parents on padded rows must be ignored.
  parents = np.where(valid, parents, rng.integers(0, q_len, parents.shape)).astype(np.int32)
  parents[:, 0] = -1
  ref = _dense_visibility(np.where(valid, parents, -1), valid)
  vis = np.asarray(jax.jit(T.visibility_from_parents)(parents, valid))
  np.testing.assert_array_equal(vis, ref)
  depth = np.asarray(T.depth_from_parents(parents, valid))
  np.testing.assert_array_equal(depth, ref.sum(-1) - 1)
  assert (depth[~valid] == 0).all()


def test_tree_from_parents_fields():
  rng = np.random.default_rng(1)
  tokens, parents, valid = _random_trees(rng, 5, 17, keep=0.6)
  start = np.array([0, 3, 100, 7, 12], np.int32)
  tree = T.tree_from_parents(tokens, parents, valid, start)
  ref = _dense_visibility(parents, valid)
  np.testing.assert_array_equal(tree.visibility, ref)
  depth = ref.sum(-1) - 1
  np.testing.assert_array_equal(tree.depth, depth)
  np.testing.assert_array_equal(tree.positions, start[:, None] + depth)
  np.testing.assert_array_equal(tree.parents, np.where(valid, parents, -1))
  np.testing.assert_array_equal(tree.tokens, tokens)
  np.testing.assert_array_equal(tree.valid, valid)
  assert (np.asarray(tree.positions)[~valid] == np.broadcast_to(start[:, None], valid.shape)[~valid]).all()
  assert tree.batch_size == 5 and tree.q_len == 17
  assert tree.tokens.dtype == np.int32 and tree.positions.dtype == np.int32


def test_tree_from_parents_traces_under_jit():
  rng = np.random.default_rng(2)
  tokens, parents, valid = _random_trees(rng, 3, 10)
  start = np.arange(3, dtype=np.int32)
  eager = T.tree_from_parents(tokens, parents, valid, start)
  jitted = jax.jit(T.tree_from_parents)(tokens, parents, valid, start)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_array_equal(a, b)


def test_window_mask_padding_rules():
  rng = np.random.default_rng(3)
  tokens, parents, valid = _random_trees(rng, 8, 24, keep=0.5)
  tree = T.tree_from_parents(tokens, parents, valid, np.zeros(8, np.int32))
  mask = np.asarray(T.window_mask(tree.visibility, tree.valid))
  vis = _dense_visibility(parents, valid)
  assert (~valid).any() and valid[:, 1:].any()
  for b in range(8):
    for i in range(24):
      if valid[b, i]:
        np.testing.assert_array_equal(mask[b, i], vis[b, i] & valid[b])
        assert not mask[b, i, ~valid[b]].any()
      else:
        np.testing.assert_array_equal(mask[b, i], np.arange(24) == i)
  assert mask.any(-1).all()


def test_window_mask_hides_padding_whatever_visibility_says():
  rng = np.random.default_rng(5)
  vis = rng.random((4, 12, 12)) < 0.5
  valid = rng.random((4, 12)) < 0.6
  mask = np.asarray(T.window_mask(vis, valid))
  eye = np.eye(12, dtype=bool)
  expected = np.where(valid[:, :, None], vis & valid[:, None, :] & valid[:, :, None], eye)
  np.testing.assert_array_equal(mask, expected)
  assert not (mask & valid[:, :, None] & ~valid[:, None, :]).any()


@pytest.mark.parametrize("mutate, message", [
    (lambda t, p, v: v.__setitem__((0, 0), False), "root"),
    (lambda t, p, v: p.__setitem__((0, 0), 2), "root"),
    (lambda t, p, v: p.__setitem__((0, 2), 3), "before their children"),
    (lambda t, p, v: p.__setitem__((0, 2), -1), "before their children"),
    (lambda t, p, v: v.__setitem__((0, 1), False), "prefix-closed"),
    (lambda t, p, v: t.__setitem__((0, 3), 10), "siblings"),
])
def test_tree_from_parents_validates_numpy(mutate, message):
  tokens = np.array([[5, 10, 20, 11]], np.int32)
  parents = np.array([[-1, 0, 1, 0]], np.int32)
  valid = np.ones((1, 4), bool)
  T.tree_from_parents(tokens, parents, valid, np.zeros(1, np.int32))
  mutate(tokens, parents, valid)
  with pytest.raises(ValueError, match=message):
    T.tree_from_parents(tokens, parents, valid, np.zeros(1, np.int32))
  with pytest.raises(ValueError, match=message):  # lists are host input too
    T.tree_from_parents(tokens.tolist(), parents.tolist(), valid.tolist(), [0])


def test_paths_round_trip():
  paths = [(3,), (0,), (3, 7), (3, 0), (0, 3), (3, 7, 7), (3, 7, 1)]
  tree = T.tree_from_paths(9, paths, start=4, q_len=10)
  assert tree.batch_size == 1 and tree.q_len == 10
  assert T.tree_to_paths(tree) == [paths]
  np.testing.assert_array_equal(tree.tokens[0, :8], [9, 3, 0, 7, 0, 3, 7, 1])
  np.testing.assert_array_equal(tree.parents[0], [-1, 0, 0, 1, 1, 2, 3, 3, -1, -1])
  np.testing.assert_array_equal(tree.positions[0], [4, 5, 5, 6, 6, 6, 7, 7, 4, 4])
  np.testing.assert_array_equal(tree.valid[0], [True] * 8 + [False] * 2)

  rng = np.random.default_rng(4)
  tokens, parents, valid = _random_trees(rng, 4, 20)
  trees = T.tree_from_parents(tokens, parents, valid, np.zeros(4, np.int32))
  for b, row_paths in enumerate(T.tree_to_paths(trees)):
    again = T.tree_from_paths(int(tokens[b, 0]), row_paths)
    assert T.tree_to_paths(again) == [row_paths]
    assert len(row_paths) == valid[b].sum() - 1


@pytest.mark.parametrize("paths, q_len, message", [
    ([(1, 2)], None, "before its prefix"),
    ([(1,), (1,)], None, "twice"),
    ([()], None, "empty"),
    ([(1,), (2,)], 2, "cannot hold"),
])
def test_tree_from_paths_errors(paths, q_len, message):
  with pytest.raises(ValueError, match=message):
    T.tree_from_paths(0, paths, q_len=q_len)


def _canonical_reference(tokens, parents, valid, root_tokens, start, max_depth, vocab_size):
  """Sequential host reference of ``canonical_tree`` (parents come before children)."""
  batch, q_len = tokens.shape
  real = np.zeros((batch, q_len), bool)
  depth = np.zeros((batch, q_len), np.int32)
  for b in range(batch):
    real[b, 0] = True
    for i in range(1, q_len):
      p = int(parents[b, i])
      if (valid[b, i] and 0 <= p < i and real[b, p] and depth[b, p] + 1 <= max_depth[b]
          and 0 <= tokens[b, i] < vocab_size):
        real[b, i], depth[b, i] = True, depth[b, p] + 1
  canon_parents = np.where(real, parents, -1).astype(np.int32)
  canon_parents[:, 0] = -1
  canon_tokens = np.where(real, tokens, 0).astype(np.int32)
  canon_tokens[:, 0] = root_tokens
  return canon_tokens, canon_parents, real, depth, _dense_visibility(canon_parents, real)


@pytest.mark.parametrize("seed", range(4))
def test_canonical_tree_repairs_any_policy_output(seed):
  """Whatever a policy puts in a Tree, the engine verifies a well-formed one built from its
  tokens, parents and valid alone (against a sequential host reference)."""
  rng = np.random.default_rng(seed)
  batch, q_len = 5, 23
  tokens = rng.integers(-3, 53, (batch, q_len)).astype(np.int32)  # some outside a vocabulary of 50
  # Parents anywhere, forward and out of range included; valid at random, root too.
  parents = rng.integers(-3, q_len + 3, (batch, q_len)).astype(np.int32)
  parents[:, 1:4] = 0  # some real children of the root in every row
  valid = rng.random((batch, q_len)) < 0.8
  root_tokens = rng.integers(0, 50, batch).astype(np.int32)
  start = rng.integers(0, 100, batch).astype(np.int32)
  max_depth = np.array([q_len, 3, 1, -2, 6], np.int32)  # below 0: the root alone
  garbage = T.Tree(tokens=tokens, parents=parents, depth=rng.integers(-5, 5, (batch, q_len)).astype(np.int32),
                   positions=rng.integers(-5, 500, (batch, q_len)).astype(np.int32),
                   visibility=rng.random((batch, q_len, q_len)) < 0.5, valid=valid)
  got = jax.jit(T.canonical_tree, static_argnames="vocab_size")(garbage, root_tokens, start, max_depth, vocab_size=50)
  want_tokens, want_parents, want_valid, want_depth, want_vis = _canonical_reference(
      tokens, parents, valid, root_tokens, start, max_depth, 50)
  assert want_valid[:, 1:].any() and not want_valid.all()  # the case has both kinds of rows
  assert want_valid[:, 0].all() and not want_valid[3, 1:].any()
  np.testing.assert_array_equal(got.valid, want_valid)
  np.testing.assert_array_equal(got.parents, want_parents)
  np.testing.assert_array_equal(got.tokens, want_tokens)
  np.testing.assert_array_equal(got.depth, want_depth)
  np.testing.assert_array_equal(got.positions, start[:, None] + want_depth)
  np.testing.assert_array_equal(got.visibility, want_vis)


def test_canonical_tree_keeps_a_well_formed_tree():
  rng = np.random.default_rng(11)
  tokens, parents, valid = _random_trees(rng, 4, 33, keep=0.7)
  tokens = np.where(valid, tokens, 0).astype(np.int32)
  start = np.array([0, 5, 17, 1000], np.int32)
  tree = T.tree_from_parents(tokens, parents, valid, start)
  same = T.canonical_tree(tree, tokens[:, 0], start)
  for field in ("tokens", "parents", "depth", "positions", "visibility", "valid"):
    np.testing.assert_array_equal(getattr(same, field), getattr(tree, field), err_msg=field)
