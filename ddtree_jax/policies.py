"""Tree policies: from the drafter's per-position top-k candidates to a flattened draft ``Tree``.

A policy is a pure, jit-able function (``budget`` static)::

  policy(root_tokens, start, ids, logprobs, budget, max_depth=None, **options) -> Tree

  root_tokens: int32[B], the previous bonus token (node 0 of every tree).
  start: int32[B], position of the root.
  ids, logprobs: int32/float32[B, L, k]; index d holds the top-k candidates for the token at
    ``start + d + 1`` (depth d + 1), log-probs sorted descending along k. Never the full vocabulary.
  budget: Python int >= 0; the tree has ``Q = budget + 1`` rows, unfilled rows are padding.
  max_depth: int32[B] or None (= L); deeper candidates are excluded before selection, so the
    budget goes to allowed depths (end of generation, cache room).

Candidates are ordered everywhere by (cumulative float32 score descending, depth ascending, rank
path lexicographic); scores accumulate parent-first (``score_child = score_parent + lp``).

Adding a policy takes a few lines, e.g. a tree of the top-2 tokens at depth 1 only::

  import jax
  import jax.numpy as jnp
  from ddtree_jax import policies, tree

  @policies.register_policy("fork2")
  def fork2(root_tokens, start, ids, logprobs, budget, max_depth=None):
    policies.check_inputs("fork2", ids, logprobs, budget, needed=min(budget, 2))
    b, n = ids.shape[0], min(budget, 2)
    tokens = jnp.concatenate([root_tokens[:, None], ids[:, 0, :n]], axis=1)
    parents = jnp.array([-1] + [0] * n + [-1] * (budget - n))
    valid = jnp.arange(budget + 1) <= n
    tokens = jnp.pad(tokens, ((0, 0), (0, budget - n)))
    return tree.tree_from_parents(tokens, jnp.broadcast_to(parents, (b, budget + 1)),
                                  jnp.broadcast_to(valid, (b, budget + 1)), start)

  policy = jax.jit(policies.get_policy("fork2"), static_argnames="budget")
  draft = policy(root_tokens, start, ids, logprobs, budget=8)
"""

import functools
import heapq
import inspect
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import tree as tree_lib
from models import ordering

_POLICIES = {}
# The layered search's scan over the drafter's positions is unrolled: on the GPU the loop's body
# is many tiny kernels and copies a position, and unrolled they fuse across positions (H100, demo
# pair, budget 16: raw step 1.46 -> 1.33 ms at batch 1 and 1.96 -> 1.63 at batch 8, identical
# tokens; docs/engine_step.md). XLA:CPU compiles it no slower. ``benchmarks/level_unroll.py``
# sets it to 1 (the loop) to compare.
LEVEL_SCAN_UNROLL = True
# On the GPU the layered search orders each set of candidates of at most this many by comparing
# every pair (``models.ordering``) instead of ``lax.sort``, which XLA runs as a copy of every
# operand and a few kernels: 15 positions x 2 sorts and a scatter a step (H100, demo pair: raw step
# 0.71-0.95x, ``docs/engine_step.md``). Past it (budget 64's 4096 candidates a position) the sort
# stays; ``benchmarks/search_ordering.py`` sets it to 0 (every set sorted) to compare.
RANK_SELECT_MAX = 1024
# Parameters every policy takes; anything else is an option bound by ``get_policy``.
_CALL_PARAMS = ("root_tokens", "start", "ids", "logprobs", "budget", "max_depth")


def register_policy(name, *, replace: bool = False):
  """Decorator adding a policy under ``name``.

  A name already taken is a ValueError unless ``replace=True``, or unless the new function is the
  same definition run again (same module and qualified name: a notebook cell re-run after an edit).
  """
  if not isinstance(name, str) or not name:
    raise TypeError(f"register_policy takes the policy's name first, as @register_policy('name'); got {name!r}")

  def register(fn):
    old = _POLICIES.get(name)
    # Only named definitions can be told apart so (partials and callable objects have no qualname).
    qualname = getattr(fn, "__qualname__", None)
    rerun = old is not None and isinstance(qualname, str) and (
        getattr(old, "__module__", None), getattr(old, "__qualname__", None)) == (getattr(fn, "__module__", None), qualname)
    if old is not None and not (replace or rerun):
      raise ValueError(f"policy {name!r} is already registered (by {getattr(old, '__module__', '?')}."
                       f"{getattr(old, '__qualname__', '?')}); pass replace=True to replace it")
    _POLICIES[name] = fn
    return fn
  return register


def available_policies():
  """Sorted tuple of registered policy names."""
  return tuple(sorted(_POLICIES))


def get_policy(name, **options):
  """The policy ``name`` with ``options`` bound (a ``functools.partial``)."""
  if name not in _POLICIES:
    raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(available_policies())}")
  return bind_options(_POLICIES[name], name, options)


def policy_options(fn) -> tuple:
  """The option names a policy function takes beyond the call's own parameters."""
  return tuple(name for name, p in inspect.signature(fn).parameters.items()
               if name not in _CALL_PARAMS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def bind_options(fn, name, options):
  """``fn`` with ``options`` bound (a ``functools.partial``); an option it does not take is a ValueError."""
  accepted = list(policy_options(fn))
  takes_any = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
  unknown = [] if takes_any else sorted(set(options) - set(accepted))
  if unknown:
    raise ValueError(f"policy {name!r} got unknown options {unknown}; it accepts {accepted}")
  return functools.partial(fn, **options)


def check_inputs(name, ids, logprobs, budget, needed, *, root_tokens=None, start=None, max_depth=None):
  """Host-side (trace-time) checks shared by policies.

  Args:
    name: policy name, for messages.
    ids, logprobs: [B, L, k] candidates.
    budget: must be a Python int >= 0.
    needed: how many ranks per position the policy may select at this budget.
    root_tokens, start, max_depth: when given, each must be [B] (max_depth may be None).
  """
  if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
    raise ValueError(f"{name}: budget must be a static int >= 0, got {budget!r}")
  if len(ids.shape) != 3 or tuple(logprobs.shape) != tuple(ids.shape):
    raise ValueError(
        f"{name}: ids and logprobs must share one [B, L, k] shape; got {ids.shape}, "
        f"{logprobs.shape}")
  for arg, value in (("root_tokens", root_tokens), ("start", start), ("max_depth", max_depth)):
    if value is not None and tuple(np.shape(value)) != tuple(ids.shape[:1]):
      raise ValueError(f"{name}: {arg} must be [B] = {list(ids.shape[:1])} (one per request), got shape "
                       f"{list(np.shape(value))}")
  k = ids.shape[-1]
  if k < needed:
    raise ValueError(
        f"{name}: budget={budget} can select rank {needed - 1} at a position but only k={k} "
        f"candidates were given; hand over k >= {needed} (the engine hands k = its largest budget)")


def _max_depth(max_depth, batch, n_levels):
  """int32[B] depth caps clipped to [0, L]; None means L."""
  if max_depth is None:
    return jnp.full((batch,), n_levels, jnp.int32)
  return jnp.clip(jnp.asarray(max_depth, jnp.int32), 0, n_levels)


def _assemble(root_tokens, start, tokens, parents, valid):
  """Tree from the ``budget`` non-root rows of each request.

  Args:
    root_tokens, start: int32[B].
    tokens, parents: int32[B, N]; parents index the full [0, N] row range (0 = root).
    valid: bool[B, N].
  """
  tokens = jnp.concatenate([jnp.asarray(root_tokens, jnp.int32)[:, None],
                            jnp.where(valid, tokens, 0)], axis=1)
  batch = tokens.shape[0]
  parents = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parents], axis=1)
  valid = jnp.concatenate([jnp.ones((batch, 1), bool), valid], axis=1)
  return tree_lib.tree_from_parents(tokens, parents, valid, jnp.asarray(start, jnp.int32))


def root_only_tree(root_tokens, start, budget: int = 0):
  """A tree holding only each root (plus ``budget`` padded rows): autoregressive decoding."""
  batch = root_tokens.shape[0]
  zeros = jnp.zeros((batch, budget), jnp.int32)
  return _assemble(root_tokens, start, zeros, zeros, jnp.zeros((batch, budget), bool))


def _layered_search(logprobs, max_depth, budget, n_keep, n_child, n_pool):
  """Static-shape layered best-first search for one request.

  Every depth extends the ``n_keep`` best prefixes of the previous depth by their ``n_child`` best
  tokens and sorts the candidates; the ``n_pool`` best of each depth then compete globally for the
  budget. With ``n_keep = n_pool = budget`` and ``n_child = min(budget, k)`` this is exactly the
  DDTree heap (the global top-N holds at most N nodes per depth, each extending a top-N prefix).

  Args:
    logprobs: float32[L, k], L >= 1.
    max_depth: int32 scalar cap.
    budget, n_keep, n_child, n_pool: static ints, n_keep <= n_pool <= budget.
  Returns:
    (level, rank, parents, valid), each [budget]: depth - 1, rank at that depth, parent row in
    [0, budget] (0 = root), real node. Rows are in the total order (parents first).
  """
  n_levels = logprobs.shape[0]
  width = max(n_keep, n_pool)
  child_rank = jnp.arange(n_child, dtype=jnp.int32)

  def level(carry, xs):
    kept_score, kept_lex, kept_valid = carry
    lp, depth = xs
    # score_child = score_parent + lp, rounded in float32 as in the heap reference.
    score = (kept_score[:, None] + lp[None, :n_child]).reshape(-1)
    invalid = (~(kept_valid[:, None] & (depth <= max_depth))).astype(jnp.int32)
    invalid = jnp.broadcast_to(invalid, (n_keep, n_child)).reshape(-1)
    # Children of lexicographically ordered prefixes, ordered by (prefix, own rank).
    lex = (kept_lex[:, None] * n_child + child_rank[None]).reshape(-1)
    best = ordering.stable_order(invalid, -score, lex, count=width, max_pairwise=RANK_SELECT_MAX)
    invalid, neg_score, lex = invalid[best], -score[best], lex[best]
    parent, rank = best // n_child, best % n_child
    # Re-densify the lexicographic keys so the next depth's keys stay below width * n_child.
    dense_lex = ordering.stable_ranks(invalid, lex, max_pairwise=RANK_SELECT_MAX)
    valid = invalid == 0
    next_carry = (-neg_score[:n_keep], dense_lex[:n_keep], valid[:n_keep])
    in_pool = valid & (jnp.arange(width) < n_pool)
    return next_carry, (-neg_score, dense_lex, in_pool, parent, rank)

  root = (jnp.zeros(n_keep, jnp.float32), jnp.zeros(n_keep, jnp.int32),
          jnp.arange(n_keep) == 0)
  depths = jnp.arange(1, n_levels + 1, dtype=jnp.int32)
  _, (score, lex, in_pool, parent, rank) = jax.lax.scan(level, root, (logprobs, depths), unroll=LEVEL_SCAN_UNROLL)

  flat_level = jnp.repeat(jnp.arange(n_levels, dtype=jnp.int32), width)
  flat = lambda x: x.reshape(-1)
  n_sel = min(budget, n_levels * width)
  ranks = ordering.stable_ranks((~flat(in_pool)).astype(jnp.int32), -flat(score), flat_level, flat(lex),
                                max_pairwise=RANK_SELECT_MAX)
  index = ordering.by_rank(ranks, n_sel)
  valid = flat(in_pool)[index]
  row = jnp.where(ranks < n_sel, ranks + 1, 0)  # the selected nodes' rows, 1 .. n_sel
  node_level = flat_level[index]
  parent_flat = (node_level - 1) * width + flat(parent)[index]
  parents = jnp.where(node_level == 0, 0, row[jnp.maximum(parent_flat, 0)])
  pad = lambda x: jnp.pad(x, (0, budget - n_sel))
  return (pad(node_level), pad(flat(rank)[index]), pad(parents), pad(valid))


def _search_policy(root_tokens, start, ids, logprobs, budget, max_depth, n_keep, n_child, n_pool):
  """Runs ``_layered_search`` over the batch and gathers tokens into a Tree."""
  batch, n_levels, _ = ids.shape
  if budget == 0 or n_levels == 0:
    return root_only_tree(root_tokens, start, budget)
  search = functools.partial(_layered_search, budget=budget, n_keep=n_keep, n_child=n_child,
                             n_pool=n_pool)
  # Scores must not grow along a path, or a deep node can outrank its ancestors and the chosen
  # set stops being prefix-closed. Log-probabilities are <= 0, but rounding (a bf16 log_softmax,
  # an epsilon floor) can lift the top one just above: such values count as 0.
  logprobs = jnp.minimum(jnp.asarray(logprobs, jnp.float32), 0.0)
  level, rank, parents, valid = jax.vmap(search)(logprobs, _max_depth(max_depth, batch, n_levels))
  tokens = jnp.asarray(ids, jnp.int32)[jnp.arange(batch)[:, None], level, rank]
  return _assemble(root_tokens, start, tokens, parents, valid)


@register_policy("ddtree")
def ddtree(root_tokens, start, ids, logprobs, budget, max_depth=None):
  """DDTree (DESIGN 1.2): the ``budget`` best prefixes by cumulative log-prob, best-first order.

  Log-probs above 0 count as 0 (see ``_search_policy``).

  Computed on device with static shapes: top-N prefixes per depth, each extended by its
  top-min(N, k) tokens, then the global top N. Requires k >= budget. Rows come out in the heap's
  emission order (``ddtree_heap_reference``).
  """
  check_inputs("ddtree", ids, logprobs, budget, needed=budget, root_tokens=root_tokens, start=start,
               max_depth=max_depth)
  n_child = min(budget, ids.shape[-1])
  return _search_policy(root_tokens, start, ids, logprobs, budget, max_depth,
                        n_keep=budget, n_child=n_child, n_pool=budget)


@register_policy("beam")
def beam(root_tokens, start, ids, logprobs, budget, max_depth=None, width=4):
  """EAGLE-2-style beam tree: per depth the ``width`` best nodes by cumulative score are expanded
  by their ``width`` best tokens; all generated nodes are reranked globally to the budget (same
  order as ``ddtree``; a parent always outranks its child, so the tree stays prefix-closed).
  With ``width >= budget`` it equals ``ddtree``. Requires k >= min(width, budget).
  """
  if isinstance(width, bool) or not isinstance(width, numbers.Integral) or width < 1:
    raise ValueError(f"beam: width must be an int >= 1, got {width!r}")
  n_keep = min(width, budget)
  check_inputs("beam", ids, logprobs, budget, needed=n_keep, root_tokens=root_tokens, start=start,
               max_depth=max_depth)
  return _search_policy(root_tokens, start, ids, logprobs, budget, max_depth, n_keep=n_keep,
                        n_child=n_keep, n_pool=min(n_keep * n_keep, budget))


@register_policy("chain")
def chain(root_tokens, start, ids, logprobs, budget, max_depth=None):
  """DFlash linear draft: the argmax (rank 0) path, min(budget, L, max_depth) nodes."""
  check_inputs("chain", ids, logprobs, budget, needed=min(budget, 1), root_tokens=root_tokens, start=start,
               max_depth=max_depth)
  batch, n_levels, _ = ids.shape
  n = min(budget, n_levels)
  cap = _max_depth(max_depth, batch, n_levels)
  tokens = jnp.pad(jnp.asarray(ids, jnp.int32)[:, :n, 0], ((0, 0), (0, budget - n)))
  node = jnp.arange(1, budget + 1, dtype=jnp.int32)
  valid = node[None, :] <= jnp.minimum(cap, n)[:, None]
  parents = jnp.broadcast_to(node - 1, (batch, budget))
  return _assemble(root_tokens, start, tokens, parents, valid)


def ddtree_heap_reference(logprobs_row, budget, max_depth=None):
  """DESIGN 1.2 best-first heap for one request (host, numpy), the reference for ``ddtree``.

  Args:
    logprobs_row: float[L, k], sorted descending along k.
    budget: int >= 0, nodes to emit.
    max_depth: int or None (= L).
  Returns:
    list of rank-path tuples (one rank per depth) in emission order.
  """
  lp = np.minimum(np.asarray(logprobs_row, np.float32), np.float32(0))  # as ``_search_policy``
  n_levels, k = lp.shape
  cap = n_levels if max_depth is None else min(int(max_depth), n_levels)
  heap = []

  def push(parent_score, path):
    # Parent-first float32 accumulation; float() of a float32 is exact and -0.0 == 0.0 in the
    # comparison, as in the device sort.
    score = np.float32(parent_score + lp[len(path) - 1, path[-1]])
    heapq.heappush(heap, (-float(score), len(path), path, score, parent_score))

  if cap >= 1 and k >= 1:
    push(np.float32(0.0), (0,))
  out = []
  while heap and len(out) < budget:
    _, depth, path, score, parent_score = heapq.heappop(heap)
    out.append(path)
    if path[-1] + 1 < k:
      push(parent_score, path[:-1] + (path[-1] + 1,))
    if depth < cap:
      push(score, path + (0,))
  return out


def prior_rank_paths(num_paths=128, max_depth=15, top1=0.8):
  """Rank paths of a fixed tree: the DDTree of a position-independent rank prior (host).

  The prior says the rank-r candidate is the target's token with probability
  ``top1 * (1 - top1) ** r`` at every depth (top-1 right ``top1`` of the time, each further rank
  taking the same share of what is left), so a path's value is the product over its ranks, as in
  Sequoia-style static trees. Paths come best-first (ties as in ``ddtree``): parents first, and
  every prefix of the list is a tree.

  Returns:
    tuple of ``num_paths`` rank tuples.
  """
  # Every rank a list of num_paths paths could use (a flat prior, small top1, reaches far ranks).
  n_ranks = num_paths
  log_prior = np.log(top1 * (1.0 - top1) ** np.arange(n_ranks)).astype(np.float32)
  rows = np.broadcast_to(log_prior, (max_depth, n_ranks))
  return tuple(ddtree_heap_reference(rows, num_paths))


DEFAULT_RANK_PATHS = prior_rank_paths()


def _static_plan(rank_paths, n_levels, budget):
  """Validates ``rank_paths`` and keeps those some depth cap can select (host, static).

  Returns:
    (depth, parent, last_rank, needed): int arrays over the kept paths (parent = index of the
    parent path, -1 for depth 1) and the number of ranks per position the plan reads.
  """
  index = {}
  for i, path in enumerate(rank_paths):
    path = tuple(path)
    if not path or any(isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0
                       for r in path):
      raise ValueError(f"static: rank path {i} {path!r} must be a non-empty tuple of ranks >= 0")
    if path in index:
      raise ValueError(f"static: rank path {path} appears twice")
    if len(path) > 1 and path[:-1] not in index:
      raise ValueError(
          f"static: rank path {path} comes before its parent {path[:-1]}; order parents first so "
          "that every truncation stays a tree")
    index[path] = i
  paths = [tuple(p) for p in rank_paths if len(p) <= n_levels]
  depth = np.array([len(p) for p in paths], np.int32)
  # Under cap c the tree is the first `budget` paths of depth <= c; keep the union over caps.
  used = np.zeros(len(paths), bool)
  for cap in range(1, n_levels + 1):
    allowed = depth <= cap
    used |= allowed & (np.cumsum(allowed) <= budget)
  n_used = int(np.nonzero(used)[0].max()) + 1 if used.any() else 0
  paths = paths[:n_used]
  position = {p: i for i, p in enumerate(paths)}
  parent = np.array([position[p[:-1]] if len(p) > 1 else -1 for p in paths], np.int32)
  last_rank = np.array([p[-1] for p in paths], np.int32)
  needed = int(max((p[-1] for p, u in zip(paths, used) if u), default=-1)) + 1
  return depth[:n_used], parent, last_rank, needed


@register_policy("static")
def static(root_tokens, start, ids, logprobs, budget, max_depth=None,
           rank_paths=DEFAULT_RANK_PATHS):
  """A fixed tree given by rank paths (Medusa/Sequoia style).

  ``rank_paths`` lists rank tuples with parents first (validated). Each request uses the first
  ``budget`` paths whose depth fits ``min(L, max_depth)``; dropping deeper paths keeps the list
  parent-first, so the tree stays prefix-closed. Node tokens are ``ids`` at those ranks; logprobs
  are not read. Requires k > every rank the budget can reach. Default: ``DEFAULT_RANK_PATHS``.
  """
  # Budget and shapes first: the plan below depends on the budget, the k check on the plan.
  check_inputs("static", ids, logprobs, budget, needed=0, root_tokens=root_tokens, start=start, max_depth=max_depth)
  batch, n_levels, _ = ids.shape
  depth, parent, last_rank, needed = _static_plan(rank_paths, n_levels, budget)
  check_inputs("static", ids, logprobs, budget, needed=needed)
  if budget == 0 or depth.size == 0:
    return root_only_tree(root_tokens, start, budget)
  cap = _max_depth(max_depth, batch, n_levels)
  allowed = depth[None, :] <= cap[:, None]
  row = jnp.cumsum(allowed, axis=1, dtype=jnp.int32)  # 1-based row of each allowed path
  take = allowed & (row <= budget)
  parent_row = jnp.where(parent[None, :] < 0, 0, jnp.take(row, jnp.maximum(parent, 0), axis=1))
  tokens = jnp.asarray(ids, jnp.int32)[:, depth - 1, last_rank]
  # Unselected paths scatter out of range and are dropped.
  dest = jnp.where(take, row - 1, budget)
  scatter = lambda x, d: jnp.zeros(budget, x.dtype).at[d].set(x, mode="drop")
  out = [jax.vmap(scatter)(x, dest) for x in (tokens, parent_row, take)]
  return _assemble(root_tokens, start, *out)
