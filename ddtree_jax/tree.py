"""Draft trees flattened for one verify forward, and the one owner of the tree mask convention.

Convention (used by the attention reference, the Pallas kernel and every policy):
  * node 0 is the root (the previous bonus token at position ``start``); node i sits at
    ``start + depth[i]``; parents come before children;
  * ``visibility[b, i, j]`` is True iff node j is node i or an ancestor of node i;
  * ``valid[b, i]`` marks real nodes. The effective window mask (``window_mask``) hides padded
    columns from real rows and lets a padded row see only itself, so no row is ever all-masked.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def window_mask(visibility, valid):
  """Effective attention mask over the tree window.

  Args:
    visibility: bool[B, Q, Q], True where row i may see window column j (ancestor-or-self).
    valid: bool[B, Q], real nodes.
  Returns:
    bool[B, Q, Q]: real rows see visible, valid columns; padded rows see only themselves.
  """
  q_len = visibility.shape[-1]
  eye = jnp.eye(q_len, dtype=bool)
  real = visibility & valid[:, None, :] & valid[:, :, None]
  return jnp.where(valid[:, :, None], real, eye[None])


def window_mask_bits(visibility, valid):
  """``window_mask`` bit-packed by row, the form the Pallas tree-attention kernel reads.

  Args:
    visibility: bool[B, Q, Q]; valid: bool[B, Q] (as in ``window_mask``).
  Returns:
    int32[B, Q, W] with W = ceil(Q / 32): bit ``j % 32`` of word ``j // 32`` of row i is
    ``window_mask(visibility, valid)[b, i, j]``; bits for j >= Q are 0.
  """
  mask = window_mask(visibility, valid)
  batch, q_len = mask.shape[:2]
  words = -(-q_len // 32)
  mask = jnp.pad(mask, ((0, 0), (0, 0), (0, words * 32 - q_len)))
  bits = mask.reshape(batch, q_len, words, 32).astype(jnp.uint32)
  # Shifts and ors of 32 slices rather than a sum over an axis: elementwise, so XLA fuses the
  # packing into whatever consumes it (the kernel's metadata) instead of a separate reduction.
  packed = bits[..., 0]
  for bit in range(1, 32):
    packed = packed | jnp.left_shift(bits[..., bit], jnp.uint32(bit))
  return jax.lax.bitcast_convert_type(packed, jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  """A batch of draft trees flattened to ``Q = budget + 1`` rows (all arrays ``[B, Q]`` unless noted).

  Attributes:
    tokens: int32, node tokens; node 0 is the root (the previous bonus token).
    parents: int32, parent node index; -1 for the root and for padded rows.
    depth: int32, 0 for the root; padded rows carry 0.
    positions: int32, ``start + depth`` (padded rows: ``start``, a valid position).
    visibility: bool[B, Q, Q], ancestor-or-self relation (padded rows: only themselves).
    valid: bool, real nodes. Token id 0 is a real token: padding is only ever read from here.
  """

  tokens: jax.Array
  parents: jax.Array
  depth: jax.Array
  positions: jax.Array
  visibility: jax.Array
  valid: jax.Array

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def q_len(self) -> int:
    return self.tokens.shape[1]


def visibility_from_parents(parents, valid):
  """Ancestor-or-self relation of flattened trees.

  Args:
    parents: int32[B, Q], parent node index, -1 for the root and for padded rows.
    valid: bool[B, Q], real nodes; padded rows see only themselves whatever their parent says.
  Returns:
    bool[B, Q, Q]: ``[b, i, j]`` is True iff node j is node i or one of its ancestors.
  """
  q_len = parents.shape[-1]
  parents = jnp.where(valid, parents, -1)
  eye = jnp.eye(q_len, dtype=bool)
  # reach[i, j]: j is within distance 1 above i; squaring doubles the distance covered, so
  # ceil(log2(Q - 1)) squarings reach every ancestor with static shapes and no per-node loop.
  reach = eye[None] | (parents[:, :, None] == jnp.arange(q_len)[None, None, :])
  for _ in range(max(q_len - 2, 0).bit_length()):
    r = reach.astype(jnp.float32)
    # Counts stay below Q, exact in float32 whatever the matmul precision.
    reach = jnp.einsum("bij,bjk->bik", r, r, precision=jax.lax.Precision.HIGHEST) > 0
  return reach


def depth_from_parents(parents, valid):
  """Depth of every node (number of strict ancestors).

  Args:
    parents: int32[B, Q]; valid: bool[B, Q] (as in ``visibility_from_parents``).
  Returns:
    int32[B, Q]: 0 for the root and for padded rows.
  """
  return depth_from_visibility(visibility_from_parents(parents, valid))


def depth_from_visibility(visibility):
  """int32[B, Q] depth from a bool[B, Q, Q] ancestor-or-self relation."""
  return jnp.sum(visibility, axis=-1, dtype=jnp.int32) - 1


def _check_parents(tokens, parents, valid, start):
  """Host-side structural checks of ``tree_from_parents`` inputs (numpy arrays)."""
  if tokens.ndim != 2 or parents.shape != tokens.shape or valid.shape != tokens.shape:
    raise ValueError(
        f"tokens, parents and valid must share one [B, Q] shape; got {tokens.shape}, "
        f"{parents.shape}, {valid.shape}")
  if start.shape != tokens.shape[:1]:
    raise ValueError(f"start must be [B] = {tokens.shape[:1]}; got {start.shape}")
  if tokens.shape[1] < 1:
    raise ValueError("a tree needs at least the root row (Q >= 1)")
  for b in range(tokens.shape[0]):
    if not valid[b, 0] or parents[b, 0] != -1:
      raise ValueError(f"row {b}: node 0 must be the valid root with parent -1")
    children = {}
    for i in range(1, tokens.shape[1]):
      if not valid[b, i]:
        continue
      p = int(parents[b, i])
      if not 0 <= p < i:
        raise ValueError(
            f"row {b}: node {i} has parent {p}; parents must come before their children")
      if not valid[b, p]:
        raise ValueError(f"row {b}: valid node {i} has padded parent {p} (valid not prefix-closed)")
      siblings = children.setdefault(p, set())
      if int(tokens[b, i]) in siblings:
        raise ValueError(f"row {b}: node {i} repeats token {int(tokens[b, i])} among its siblings")
      siblings.add(int(tokens[b, i]))


def tree_from_parents(tokens, parents, valid, start):
  """Builds a ``Tree`` from parent pointers (jit-able).

  Given host inputs (numpy arrays or lists, e.g. in a notebook) the structure is validated first:
  root at node 0, parents before children, valid prefix-closed, sibling tokens distinct. If any
  input is a jax array or tracer, nothing is checked, so a policy inside jit never syncs with the
  host (the engine rebuilds what it verifies anyway: ``canonical_tree``).

  Args:
    tokens: int32[B, Q]; tokens[:, 0] is the root (previous bonus token).
    parents: int32[B, Q], parent index (< own index), -1 for the root; ignored on padded rows.
    valid: bool[B, Q], real nodes.
    start: int32[B], position of the root.
  Returns:
    Tree with depth/positions/visibility derived; padded rows get parent -1, depth 0, position start.
  """
  if not any(isinstance(x, jax.Array) for x in (tokens, parents, valid, start)):
    _check_parents(np.asarray(tokens), np.asarray(parents), np.asarray(valid).astype(bool), np.asarray(start))
  return _build_tree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
                     jnp.asarray(valid, bool), jnp.asarray(start, jnp.int32))


@jax.jit
def _build_tree(tokens, parents, valid, start):
  # Jitted so that host callers (notebooks, tests) run one executable rather than op by op.
  parents = jnp.where(valid, parents, -1)
  visibility = visibility_from_parents(parents, valid)
  depth = depth_from_visibility(visibility)
  return Tree(tokens=tokens, parents=parents, depth=depth, positions=start[:, None] + depth,
              visibility=visibility, valid=valid)


def canonical_tree(tree, root_tokens, start, max_depth=None, vocab_size=None):
  """The tree the engine verifies: a policy's ``tokens``, ``parents`` and ``valid``, nothing else.

  Lossless output must not rest on a policy getting every field right, so the engine keeps only
  what a policy chooses and derives the rest (jit-able, no host sync):
    * the root is each request's ``root_tokens`` at ``start``, always real;
    * a node is real only if the policy says so, its parent lies in ``[0, i)``, every ancestor is
      real, its depth is at most ``max_depth`` and its token lies in ``[0, vocab_size)`` (each
      check when given: a token the target can never draw is never accepted, and one outside
      its embedding would reach the verify forward as NaN); every other row is padding (parent
      -1, token 0, depth 0);
    * ``depth``, ``positions`` and ``visibility`` follow from the parents.
  A well-formed tree (``tree_from_parents``) comes back unchanged but for its padded rows' tokens
  (0). Duplicate sibling tokens are left alone: they waste budget but cannot change what the walk
  accepts.

  Args:
    tree: a ``Tree`` ([B, Q]); only its tokens, parents and valid are read.
    root_tokens, start: int32[B]; max_depth: int32[B] or None; vocab_size: int or None.
  Returns:
    Tree.
  """
  q_len = tree.tokens.shape[1]
  index = jnp.arange(q_len, dtype=jnp.int32)[None, :]
  parents = jnp.asarray(tree.parents, jnp.int32)
  placed = (index == 0) | ((parents >= 0) & (parents < index))
  tokens = jnp.asarray(tree.tokens, jnp.int32)
  if vocab_size is not None:  # descendants of a dropped node drop with it (below)
    placed = placed & (tokens >= 0) & (tokens < vocab_size)
  valid = (jnp.asarray(tree.valid, bool) & placed).at[:, 0].set(True)
  parents = jnp.where(valid & (index > 0), parents, -1)
  visibility = visibility_from_parents(parents, valid)  # chains end at padding or the root
  depth = depth_from_visibility(visibility)
  # Real iff every node on the chain is real (then the chain ends at the root).
  valid = valid & ~jnp.any(visibility & ~valid[:, None, :], axis=-1)
  if max_depth is not None:  # descendants are deeper still, so the set stays closed; the root stays
    valid = valid & (depth <= jnp.maximum(jnp.asarray(max_depth, jnp.int32), 0)[:, None])
  visibility = jnp.where(valid[:, :, None], visibility, jnp.eye(q_len, dtype=bool)[None])
  depth = jnp.where(valid, depth, 0)
  tokens = jnp.where(valid, tokens, 0).at[:, 0].set(jnp.asarray(root_tokens, jnp.int32))
  start = jnp.asarray(start, jnp.int32)
  return Tree(tokens=tokens, parents=jnp.where(valid, parents, -1), depth=depth,
              positions=start[:, None] + depth, visibility=visibility, valid=valid)


def tree_from_paths(root_token, paths, start=0, q_len=None):
  """A one-request tree (batch 1) from token paths, for tests and notebooks (host).

  Args:
    root_token: int, the root (previous bonus) token.
    paths: sequence of token tuples, one per non-root node, in node order; every proper prefix of
      a path must appear earlier (the root, the empty path, is implicit).
    start: int, position of the root.
    q_len: rows of the flattened tree (default ``len(paths) + 1``); extra rows are padding.
  Returns:
    Tree with B = 1.
  """
  paths = [tuple(int(t) for t in p) for p in paths]
  q_len = len(paths) + 1 if q_len is None else q_len
  if q_len < len(paths) + 1:
    raise ValueError(f"q_len={q_len} cannot hold the root and {len(paths)} paths")
  index = {(): 0}
  tokens = np.zeros((1, q_len), np.int32)
  parents = np.full((1, q_len), -1, np.int32)
  valid = np.zeros((1, q_len), bool)
  tokens[0, 0], valid[0, 0] = root_token, True
  for i, path in enumerate(paths, start=1):
    if not path:
      raise ValueError(f"path {i - 1} is empty; the root is implicit")
    if path in index:
      raise ValueError(f"path {path} appears twice")
    if path[:-1] not in index:
      raise ValueError(f"path {path} comes before its prefix {path[:-1]}")
    index[path] = i
    tokens[0, i], parents[0, i], valid[0, i] = path[-1], index[path[:-1]], True
  return tree_from_parents(tokens, parents, valid, np.array([start], np.int32))


def tree_to_paths(tree):
  """Token path of every valid non-root node, in node order (host).

  Returns:
    list over batch rows of lists of token tuples (root token excluded).
  """
  tokens, parents, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
  out = []
  for b in range(tokens.shape[0]):
    path_of = {0: ()}
    rows = []
    for i in range(1, tokens.shape[1]):
      if valid[b, i]:
        path_of[i] = path_of[int(parents[b, i])] + (int(tokens[b, i]),)
        rows.append(path_of[i])
    out.append(rows)
  return out
