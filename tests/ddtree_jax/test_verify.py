"""Tests for ddtree_jax.verify: the draw, the accept walk and losslessness end to end (float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ddtree_jax import verify as vf
from ddtree_jax.tree import Tree

P_MIN = 1e-3  # a correct sampler must not be rejected at this chi-square p-value
P_LOSSY = 1e-8  # a biased sampler must be rejected at least this strongly


# ---------------------------------------------------------------- helpers


def build_tree(parents, tokens, valid=None, start=None):
  """A Tree from numpy parents/tokens [B, Q]; rows with parent -1 (other than the root) are padding
  unless ``valid`` says otherwise. Kept local so these tests do not depend on tree.py helpers."""
  parents = np.asarray(parents, np.int32)
  tokens = np.asarray(tokens, np.int32)
  batch, q_len = parents.shape
  if valid is None:
    valid = (parents >= 0) | (np.arange(q_len) == 0)[None]
  valid = np.asarray(valid, bool)
  start = np.zeros(batch, np.int32) if start is None else np.asarray(start, np.int32)
  depth = np.zeros((batch, q_len), np.int32)
  vis = np.zeros((batch, q_len, q_len), bool)
  rows = np.arange(batch)
  for i in range(q_len):
    inner = valid[:, i] & (parents[:, i] >= 0)
    p = np.maximum(parents[:, i], 0)
    depth[:, i] = np.where(inner, depth[rows, p] + 1, 0)
    vis[:, i] = np.where(inner[:, None], vis[rows, p], False)
    vis[:, i, i] = True
  return Tree(
      tokens=jnp.asarray(tokens),
      parents=jnp.asarray(parents),
      depth=jnp.asarray(depth),
      positions=jnp.asarray(start[:, None] + depth),
      visibility=jnp.asarray(vis),
      valid=jnp.asarray(valid),
  )


def ref_accept(tokens, parents, valid, drawn, stops=()):
  """Plain-python walk of one row: (path, emitted, hit_stop)."""
  if not valid[0]:
    return [], [], False
  path, cur = [0], 0
  while True:
    kids = [c for c in range(len(tokens))
            if valid[c] and parents[c] == cur and tokens[c] == drawn[cur]]
    if not kids:
      break
    cur = kids[0]
    path.append(cur)
  emitted = [int(tokens[n]) for n in path[1:]] + [int(drawn[path[-1]])]
  for j, t in enumerate(emitted):
    if t in stops:
      return path, emitted[:j + 1], True
  return path, emitted, False


def check_against_ref(res, tree, drawn, stop_tokens=None, stop_valid=None):
  tokens, parents, valid = map(np.asarray, (tree.tokens, tree.parents, tree.valid))
  drawn = np.asarray(drawn)
  q_len = tokens.shape[1]
  for b in range(tokens.shape[0]):
    stops = ()
    if stop_tokens is not None:
      stops = {int(t) for t, v in zip(np.asarray(stop_tokens)[b], np.asarray(stop_valid)[b]) if v}
    path, emitted, hit = ref_accept(tokens[b], parents[b], valid[b], drawn[b], stops)
    pad = lambda xs: xs + [0] * (q_len - len(xs))
    assert int(res.num_accepted[b]) == len(path), b
    assert np.asarray(res.accepted_nodes[b]).tolist() == pad(path), b
    assert int(res.num_emitted[b]) == len(emitted), b
    assert np.asarray(res.emitted[b]).tolist() == pad(emitted), b
    assert bool(res.hit_stop[b]) == hit, b
    assert int(res.bonus[b]) == (int(drawn[b][path[-1]]) if path else 0), b


def random_trees(rng, batch, q_len, vocab, chain_bias=0.0, follow=0.8):
  """Random trees with distinct sibling tokens, random padding (tokens of padded rows often equal
  a draw, and some padded rows point at a real parent), and draws that often follow a child.
  ``chain_bias``: the chance that a node hangs off the node just before it (deep trees, as DDTree's
  chain-heavy ones; uniform parents give depths of about log q_len). ``follow``: the chance that a
  node's draw is one of its children's tokens."""
  parents = np.full((batch, q_len), -1, np.int32)
  tokens = rng.integers(0, vocab, (batch, q_len)).astype(np.int32)
  valid = np.zeros((batch, q_len), bool)
  for b in range(batch):
    n_real = rng.integers(0, q_len + 1)
    valid[b, :n_real] = True
    used = {}
    for i in range(1, n_real):
      while True:
        p = i - 1 if rng.random() < chain_bias else int(rng.integers(0, i))
        free = [t for t in range(vocab) if t not in used.setdefault(p, set())]
        if free:
          break
      tokens[b, i] = rng.choice(free)
      used[p].add(int(tokens[b, i]))
      parents[b, i] = p
    for i in range(n_real, q_len):  # padding: sometimes hangs off a real node, tokens include 0
      if n_real and rng.random() < 0.5:
        parents[b, i] = rng.integers(0, n_real)
      tokens[b, i] = rng.choice([0, rng.integers(0, vocab)])
  drawn = rng.integers(0, vocab, (batch, q_len)).astype(np.int32)
  for b in range(batch):
    for i in range(q_len):
      kids = [c for c in range(q_len) if parents[b, c] == i]
      if kids and rng.random() < follow:
        drawn[b, i] = tokens[b, rng.choice(kids)]  # padded kids too: they must still be refused
  return build_tree(parents, tokens, valid), jnp.asarray(drawn)


def chi2_pvalue(counts, probs, what):
  """Pearson chi-square p-value of ``counts`` against ``probs``. Cells of zero probability must be
  empty (checked, not tested); cells with expected count < 5 are pooled into one bin."""
  counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
  assert counts[probs == 0].sum() == 0, f"{what}: samples outside the support"
  n = counts.sum()
  expected = n * probs
  big = expected >= 5
  obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
  exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
  keep = exp > 0
  assert keep.sum() >= 3, f"{what}: too few cells for a meaningful test"
  stat = np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep])
  return stats.chi2.sf(stat, keep.sum() - 1)


def np_processed_probs(logits, temperature, top_k=0, top_p=1.0):
  """Independent numpy reference of temperature -> top-k -> top-p (rows of the last axis)."""
  z = np.asarray(logits, np.float64) / temperature
  probs = np.exp(z - z.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.zeros_like(probs)
  for idx in np.ndindex(probs.shape[:-1]):
    p = probs[idx]
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(p.shape, bool)
    if 0 < top_k < p.size:
      keep[order[:top_k]] = True
    else:
      keep[:] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    mass, nucleus = 0.0, np.zeros(p.shape, bool)
    for t in np.argsort(-q, kind="stable"):
      if q[t] == 0 or (top_p < 1 and mass >= top_p):
        break
      nucleus[t] = True
      mass += q[t]
    q = np.where(nucleus, q, 0)
    out[idx] = q / q.sum()
  return out


draw_jit = jax.jit(vf.draw_tokens)
accept_jit = jax.jit(vf.accept)
verify_jit = jax.jit(vf.verify)
process_jit = jax.jit(vf.process_logits)


# ---------------------------------------------------------------- accept


def test_accept_hand_built():
  # Row 0: root -> {1: tok 4, 2: tok 0}; 1 -> {3: tok 7}; 2 -> {4: tok 2}. Draw follows 2 then 4.
  # Row 1: a chain 1 -> 2 -> 3 fully accepted, bonus drawn at node 3.
  # Row 2: the draw at the root matches no child: only the bonus is emitted.
  # Row 3: budget 4, 2 real nodes; padded rows carry token 0 (= the draw) and must be refused.
  # Row 4: an empty slot (invalid root): nothing emitted, nothing accepted.
  parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, -1], [-1, 0, 0, -1, -1], [-1, 0, 1, -1, 1],
             [-1, -1, -1, -1, -1]]
  tokens = [[9, 4, 0, 7, 2], [1, 2, 3, 4, 0], [5, 1, 2, 0, 0], [5, 6, 0, 0, 0], [0, 0, 0, 0, 0]]
  valid = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]
  drawn = [[0, 3, 2, 3, 8], [2, 3, 4, 6, 1], [3, 0, 0, 0, 0], [6, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
  tree = build_tree(parents, tokens, valid)
  res = accept_jit(tree, jnp.asarray(drawn, jnp.int32))
  check_against_ref(res, tree, drawn)
  np.testing.assert_array_equal(res.num_accepted, [3, 4, 1, 2, 0])
  np.testing.assert_array_equal(res.num_emitted, [3, 4, 1, 2, 0])
  np.testing.assert_array_equal(res.accepted_nodes[0], [0, 2, 4, 0, 0])
  np.testing.assert_array_equal(res.emitted[0], [0, 2, 8, 0, 0])  # token 0 is a real accepted token
  np.testing.assert_array_equal(res.emitted[1], [2, 3, 4, 6, 0])
  np.testing.assert_array_equal(res.emitted[3], [6, 0, 0, 0, 0])
  np.testing.assert_array_equal(res.bonus, [8, 6, 3, 0, 0])


def test_padded_rows_never_accepted_token_zero():
  # The only child of the root is padding whose token (0) equals the draw (0), and it even points
  # at the root. A value-based padding check or a missing valid check would accept it.
  for q_len in (2, 3, 8):
    parents = np.full((2, q_len), -1)
    parents[0, 1:] = 0
    tokens = np.zeros((2, q_len), np.int32)
    valid = np.zeros((2, q_len), bool)
    valid[:, 0] = True
    drawn = jnp.zeros((2, q_len), jnp.int32)
    res = accept_jit(build_tree(parents, tokens, valid), drawn)
    np.testing.assert_array_equal(res.num_accepted, [1, 1])
    np.testing.assert_array_equal(res.num_emitted, [1, 1])
    np.testing.assert_array_equal(res.emitted[:, 0], [0, 0])


def test_duplicate_siblings_take_lowest_index():
  # Out of contract (siblings must be distinct), but the path must still be one chain.
  tree = build_tree([[-1, 0, 0, 1, 2]], [[1, 4, 4, 5, 5]])
  res = accept_jit(tree, jnp.asarray([[4, 5, 5, 8, 9]], jnp.int32))
  check_against_ref(res, tree, [[4, 5, 5, 8, 9]])
  np.testing.assert_array_equal(res.accepted_nodes[0], [0, 1, 3, 0, 0])


@pytest.mark.parametrize("q_len", [1, 2, 5, 9, 17])
def test_accept_fuzz_vs_python(q_len):
  rng = np.random.default_rng(q_len)
  tree, drawn = random_trees(rng, 96, q_len, vocab=5)
  stop_tokens = jnp.asarray(rng.integers(0, 5, (96, 2)), jnp.int32)
  stop_valid = jnp.asarray(rng.random((96, 2)) < 0.4)
  check_against_ref(accept_jit(tree, drawn), tree, drawn)
  res = accept_jit(tree, drawn, stop_tokens, stop_valid)
  check_against_ref(res, tree, drawn, stop_tokens, stop_valid)
  if q_len >= 5:  # the fuzz must actually exercise deep paths and stops
    assert int(jnp.max(res.num_accepted)) >= 3
    assert bool(jnp.any(res.hit_stop))


def test_accept_deep_chain_stops_at_the_first_rejection():
  # A 16-node chain whose draw rejects node 2 while every deeper node's token matches its
  # parent's draw: only the root and node 1 are accepted. A walk that checks fewer ancestors
  # than the depth (too few pointer-doubling rounds) accepts the deepest nodes as well.
  q_len = 16
  parents = [[-1] + list(range(q_len - 1))]
  tokens = [[7] + [1 + i % 3 for i in range(1, q_len)]]
  drawn = [[tokens[0][i + 1] if i + 1 < q_len else 4 for i in range(q_len)]]
  drawn[0][1] = 9  # node 2 (token 3) is not what was drawn after node 1
  tree = build_tree(parents, tokens)
  res = accept_jit(tree, jnp.asarray(drawn, jnp.int32))
  check_against_ref(res, tree, drawn)
  np.testing.assert_array_equal(res.num_accepted, [2])
  np.testing.assert_array_equal(res.emitted[0, :3], [tokens[0][1], 9, 0])


@pytest.mark.parametrize("q_len", [33, 65])
def test_accept_fuzz_deep_trees_vs_python(q_len):
  rng = np.random.default_rng(q_len)
  # Draws that almost always follow a child: long runs of matches below each rejection, which a
  # walk checking too few ancestors (fewer doubling rounds than the depth needs) would accept.
  tree, drawn = random_trees(rng, 64, q_len, vocab=5, chain_bias=0.9, follow=0.95)
  assert int(np.asarray(tree.depth).max()) >= q_len // 2
  check_against_ref(accept_jit(tree, drawn), tree, drawn)


# ---------------------------------------------------------------- stop tokens


def _chain_case():
  # root 1 -> 5 -> 6 -> 7 accepted, bonus 9; node 4 (token 3) is a rejected sibling of node 1;
  # node 5 is padding. Emitted: [5, 6, 7, 9] then padding zeros.
  parents = [[-1, 0, 1, 2, 0, -1]]
  tokens = [[1, 5, 6, 7, 3, 0]]
  drawn = jnp.asarray([[5, 6, 7, 9, 4, 0]], jnp.int32)
  return build_tree(parents, tokens), drawn


@pytest.mark.parametrize("stops,valid,num_emitted,hit", [
    ([6, 2], [1, 1], 2, True),  # inside the accepted path
    ([9, 2], [1, 1], 4, True),  # the bonus itself
    ([0, 0], [1, 1], 4, False),  # 0 equals the padded emitted values, never a real emitted token
    ([3, 1], [1, 1], 4, False),  # a rejected sibling and the (not emitted) root
    ([6, 9], [0, 1], 4, True),  # an invalid stop entry is ignored even if it matches
    ([6, 9], [0, 0], 4, False),
])
def test_stop_tokens(stops, valid, num_emitted, hit):
  tree, drawn = _chain_case()
  res = accept_jit(tree, drawn, jnp.asarray([stops], jnp.int32), jnp.asarray([valid], bool))
  assert int(res.num_emitted[0]) == num_emitted
  assert bool(res.hit_stop[0]) == hit
  assert int(res.num_accepted[0]) == 4  # what the KV commit uses does not shrink
  expected = [5, 6, 7, 9][:num_emitted]
  np.testing.assert_array_equal(res.emitted[0], expected + [0] * (6 - num_emitted))


def test_stop_token_zero_is_real():
  tree = build_tree([[-1, 0, 1]], [[4, 0, 2]])
  res = accept_jit(tree, jnp.asarray([[0, 2, 7]], jnp.int32), jnp.asarray([[0]], jnp.int32))
  np.testing.assert_array_equal(res.emitted[0], [0, 0, 0])
  assert int(res.num_emitted[0]) == 1 and bool(res.hit_stop[0]) and int(res.num_accepted[0]) == 3


# ---------------------------------------------------------------- draw


def test_greedy_is_argmax_lowest_id_on_ties():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 5, 11)).astype(np.float32)
  logits[0, 0, [3, 7]] = 10.0  # exact tie: lowest id wins
  logits[1, 2, :] = 0.0
  sampling = vf.SamplingParams.make(4, temperature=[0, 0, 0.9, 0], seed=[1, 2, 3, 4])
  positions = jnp.asarray(rng.integers(0, 100, (4, 5)), jnp.int32)
  drawn = np.asarray(draw_jit(jnp.asarray(logits), positions, sampling))
  greedy_rows = [0, 1, 3]
  np.testing.assert_array_equal(drawn[greedy_rows], np.argmax(logits[greedy_rows], -1))
  assert drawn[0, 0] == 3 and drawn[1, 2] == 0


def _sample_many(logits_row, n, temperature, top_k=0, top_p=1.0, seed0=0):
  """n draws of one logits row, one seed per batch row."""
  sampling = vf.SamplingParams.make(
      n, temperature=temperature, top_k=top_k, top_p=top_p, seed=np.arange(seed0, seed0 + n))
  logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n, 1, len(logits_row)))
  positions = jnp.full((n, 1), 17, jnp.int32)
  return np.asarray(draw_jit(logits, positions, sampling))[:, 0]


def test_sampled_frequencies_match_softmax():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=8) * 1.5
  draws = _sample_many(logits, 20000, temperature=0.7)
  counts = np.bincount(draws, minlength=8)
  assert chi2_pvalue(counts, np_processed_probs(logits, 0.7), "T=0.7") > P_MIN
  # Power check: the same statistic rejects the un-tempered distribution.
  assert chi2_pvalue(counts, np_processed_probs(logits, 1.0), "T=1 (wrong)") < P_LOSSY
  # Processed distribution: temperature, then top-k, then top-p renormalised.
  draws = _sample_many(logits, 20000, temperature=1.3, top_k=5, top_p=0.8, seed0=10**6)
  counts = np.bincount(draws, minlength=8)
  assert chi2_pvalue(counts, np_processed_probs(logits, 1.3, 5, 0.8), "top-k/top-p") > P_MIN


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (3, 1.0), (0, 0.3), (0, 0.75), (4, 0.6),
                                         (16, 1.0), (40, 1.0)])
def test_top_k_top_p_support_is_exact(top_k, top_p):
  rng = np.random.default_rng(top_k * 100 + int(top_p * 10))
  logits = rng.normal(size=16) * 0.7  # flat enough that every supported token gets sampled
  support = np_processed_probs(logits, 1.0, top_k, top_p) > 0
  processed = np.asarray(process_jit(
      jnp.asarray(logits, jnp.float32)[None, None],
      vf.SamplingParams.make(1, temperature=1.0, top_k=top_k, top_p=top_p)))[0, 0]
  np.testing.assert_array_equal(np.isfinite(processed), support)
  draws = _sample_many(logits, 4000, temperature=1.0, top_k=top_k, top_p=top_p)
  seen = np.zeros(16, bool)
  seen[draws] = True
  np.testing.assert_array_equal(seen, support)  # never outside; every supported token occurs


def test_top_k_keeps_every_token_tied_with_the_kth():
  # The truncations are value thresholds (shardable over the vocabulary): top_k = 3 over logits
  # whose 3rd to 5th values tie keeps all five; top_p keeps the tokens tied at its boundary too.
  logits = jnp.asarray([[[4.0, 3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0]]], jnp.float32)
  kept = lambda **kw: np.isfinite(np.asarray(process_jit(logits, vf.SamplingParams.make(1, 1.0, **kw))))[0, 0]
  np.testing.assert_array_equal(kept(top_k=3), [1, 1, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(kept(top_k=2), [1, 1, 0, 0, 0, 0, 0, 0])
  # Mass before the 3rd value is e^4 + e^3 over the total, below 0.95: the nucleus reaches the tie.
  np.testing.assert_array_equal(kept(top_p=0.95), [1, 1, 1, 1, 1, 0, 0, 0])


def test_no_op_truncation_and_key_derivation():
  # top_k = 0, top_k >= V and top_p = 1 are exact no-ops, even where a float32 cumulative sum
  # reaches 1.0 before the last token; and a sampled draw is exactly Gumbel-max with the key
  # fold_in(key(seed), position + 1).
  logits = np.array([[30.0, 0, -1, -2, 1, 2, 0.5, -30]], np.float32)
  for kw in ({}, {"top_k": 8}, {"top_k": 100}, {"top_p": 1.0}):
    processed = process_jit(jnp.asarray(logits)[None], vf.SamplingParams.make(1, 2.0, **kw))
    np.testing.assert_array_equal(processed[0, 0], (logits[0] - 30.0) / 2.0)
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(64, 3, 8)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 1000, (64, 3)), jnp.int32)
  seeds = rng.integers(0, 2**32, 64, dtype=np.uint64)
  base = vf.SamplingParams.make(64, temperature=0.8, seed=seeds)
  drawn = draw_jit(logits, positions, base)
  for kw in ({"top_k": 8}, {"top_p": 1.0, "top_k": 0}):
    same = draw_jit(logits, positions, vf.SamplingParams.make(64, 0.8, seed=seeds, **kw))
    np.testing.assert_array_equal(drawn, same)
  def gumbel_max(seed, position, row):
    key = jax.random.fold_in(jax.random.key(seed), position + 1)
    return jnp.argmax((row - row.max()) / 0.8 + jax.random.gumbel(key, (8,), jnp.float32, mode="high"))

  expected = jax.jit(jax.vmap(jax.vmap(gumbel_max, (None, 0, 0))))(
      jnp.asarray(seeds, jnp.uint32), positions, logits)
  np.testing.assert_array_equal(drawn, expected)


def test_gumbel_noise_reaches_its_tail():
  """The noise must not be capped. jax's default Gumbel maps one 23-bit uniform (at most 15.94),
  which undersamples tokens 16 or more nats below the top one (with Kimi's 163840 tokens all 16
  nats down: 1.0% of the draws against the softmax's 1.8%). Of 2**28 exact Gumbel(0, 1) values
  the largest stays below 17 with probability exp(-2**28 e**-17) = 2e-5 (the key is fixed, so
  the outcome is too)."""
  chunk = 2**22
  keys = jax.random.split(jax.random.key(0), 2**28 // chunk)
  largest = jax.jit(lambda ks: jax.lax.map(lambda k: vf.gumbel_noise(k, chunk).max(), ks).max())(keys)
  assert float(largest) > 17.0


def test_tiny_temperatures_draw_the_top_token():
  """logits / T overflowed for tiny valid temperatures (token 0 drawn, or NaN); the row max is
  subtracted first."""
  logits = jnp.asarray([[[40.0, 50.0, -3.0]], [[0.0, 1.0, -3.0]]], jnp.float32)
  for temperature in (1e-37, 1e-45):
    sampling = vf.SamplingParams.make(2, temperature=temperature, seed=[1, 2])
    processed = np.asarray(process_jit(logits, sampling))
    assert not np.isnan(processed).any()  # (1e-45, a float32 denormal, is flushed to 0 by XLA: greedy)
    np.testing.assert_array_equal(processed[:, 0].argmax(-1), [1, 1])
    drawn = np.asarray(draw_jit(logits, jnp.zeros((2, 1), jnp.int32), sampling))
    np.testing.assert_array_equal(drawn[:, 0], [1, 1])


def test_key_invariance_across_batch_and_budget():
  # The same (logits row, seed, position) lands at different batch rows and node indices of
  # batches of different sizes and Q, among other requests with other settings.
  rng = np.random.default_rng(4)
  n, vocab = 40, 32
  rows = rng.normal(size=(n, vocab)).astype(np.float32)
  seeds = rng.integers(0, 2**31, n)
  pos = rng.integers(0, 5000, n)
  temps, top_ks, top_ps = rng.uniform(0.2, 2, n), rng.choice([0, 5], n), rng.choice([1.0, 0.9], n)

  def place(batch, q_len):
    logits = rng.normal(size=(batch, q_len, vocab)).astype(np.float32)
    positions = rng.integers(0, 5000, (batch, q_len)).astype(np.int32)
    t = rng.choice([0.0, 1.0], batch)
    k, p, s = np.zeros(batch, int), np.ones(batch), rng.integers(0, 2**31, batch)
    at_b = rng.permutation(batch)[:n]
    at_q = rng.integers(0, q_len, n)
    logits[at_b, at_q] = rows
    positions[at_b, at_q] = pos
    t[at_b], k[at_b], p[at_b], s[at_b] = temps, top_ks, top_ps, seeds
    sampling = vf.SamplingParams.make(batch, temperature=t, top_k=k, top_p=p, seed=s)
    drawn = draw_jit(jnp.asarray(logits), jnp.asarray(positions), sampling)
    return np.asarray(drawn)[at_b, at_q]

  a, b = place(n, 1), place(53, 9)
  np.testing.assert_array_equal(a, b)
  assert len(set(a.tolist())) > 5  # not trivially constant


# ---------------------------------------------------------------- end to end on a micro model

V_MICRO = 8
ROOT = 3
# Tree shapes over Q = 3 nodes (budget 2): a chain of 1 (padded to Q = 3), a chain of 2, a fan of 2.
SHAPES = np.array([[-1, 0, -1], [-1, 0, 1], [-1, 0, 0]], np.int32)
SHAPE_NAMES = ("chain1", "chain2", "fan2")


def micro_model():
  rng = np.random.default_rng(7)
  target = rng.normal(size=(V_MICRO, V_MICRO))
  target[np.arange(V_MICRO), rng.permutation(V_MICRO)] += 4.0  # peaked bigrams: top p ~0.7-0.9
  drafter = target + rng.normal(size=target.shape) * 0.5  # correlated: drafts often accepted
  return target.astype(np.float32), drafter


def draft_trees(rng, drafter, roots, positions, shapes, shape_ids):
  """Samples drafts from the drafter (numpy randomness, independent of the target's keys)."""
  batch = roots.shape[0]
  parents = shapes[shape_ids]
  gumbel = lambda: rng.gumbel(size=(batch, V_MICRO))
  first_two = np.argsort(-(drafter[roots] + gumbel()), axis=-1)[:, :2]  # top-2 without replacement
  c1 = first_two[:, 0]
  c2_chain = np.argmax(drafter[c1] + gumbel(), axis=-1)
  third = np.where(parents[:, -1] == 1, c2_chain, first_two[:, 1])  # chain or second sibling
  tokens = np.stack([roots, c1, third], axis=1)[:, :parents.shape[1]]
  tokens = np.where(parents >= 0, tokens, 0)  # padding carries token 0, a real token id
  tokens[:, 0] = roots
  return build_tree(parents, tokens, start=positions)


@jax.jit
def lossy_verify(logits, tree, sampling):
  """A deliberately biased verify: accept a child whenever its token is the target's argmax."""
  drawn = vf.draw_tokens(logits, tree.positions, sampling)
  top = jnp.argmax(logits, axis=-1)
  idx = jnp.arange(tree.q_len)
  child_of = tree.valid[:, None, :] & (tree.parents[:, None, :] == idx[None, :, None])
  child_is_top = jnp.any(child_of & (tree.tokens[:, None, :] == top[:, :, None]), axis=-1)
  return vf.accept(tree, jnp.where(child_is_top, top, drawn).astype(jnp.int32))


def speculate(target, drafter, sampling, num_tokens, verify_fn=verify_jit, seed=0, shapes=SHAPES):
  """Runs speculative decoding from ROOT at position 0 until every row has num_tokens tokens;
  row b drafts trees of shape ``shapes[b % len(shapes)]``.
  Returns (tokens [B, num_tokens], accepted draft tokens of the first step [B], shape ids [B])."""
  rng = np.random.default_rng(seed)
  batch = sampling.batch_size
  q_len = shapes.shape[1]
  shape_ids = np.arange(batch) % len(shapes)
  roots = np.full(batch, ROOT, np.int32)
  positions = np.zeros(batch, np.int32)
  out = np.zeros((batch, num_tokens + q_len), np.int32)
  n_out = np.zeros(batch, np.int32)
  first_accepted = None
  rows = np.arange(batch)
  for _ in range(num_tokens):  # every step emits at least one token
    tree = draft_trees(rng, drafter, roots, positions, shapes, shape_ids)
    logits = jnp.asarray(target)[tree.tokens]  # bigram target: the logits depend on the node token
    res = jax.tree.map(np.asarray, verify_fn(logits, tree, sampling))
    for j in range(q_len):
      put = (j < res.num_emitted) & (n_out + j < out.shape[1])
      out[rows[put], (n_out + j)[put]] = res.emitted[put, j]
    n_out += res.num_emitted
    roots, positions = res.bonus, positions + res.num_accepted
    if first_accepted is None:
      first_accepted = res.num_accepted - 1
  return out[:, :num_tokens], first_accepted, shape_ids


def joint_counts(tokens):
  return np.bincount(tokens[:, 0] * V_MICRO + tokens[:, 1], minlength=V_MICRO**2)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 5, 0.95)])
def test_lossless_sampling_micro_model(temperature, top_k, top_p):
  target, drafter = micro_model()
  n = 30000
  sampling = vf.SamplingParams.make(n, temperature, top_k, top_p, seed=np.arange(n) + 12345)
  cond = np_processed_probs(target, temperature, top_k, top_p)  # [prev, next]
  joint = cond[ROOT][:, None] * cond  # p(t1) p(t2 | t1)
  tokens, accepted, shape_ids = speculate(target, drafter, sampling, 2)
  for s, name in enumerate(SHAPE_NAMES):  # each tree shape is lossless on its own
    pval = chi2_pvalue(joint_counts(tokens[shape_ids == s]), joint, name)
    assert pval > P_MIN, (name, pval)
    assert accepted[shape_ids == s].mean() > 0.4, (name, accepted[shape_ids == s].mean())
  assert accepted[shape_ids == 1].mean() > 0.8  # chains of 2 often fully accepted

  if top_k == 0:  # the same statistic rejects a lossy verify
    lossy, _, _ = speculate(target, drafter, sampling, 2, verify_fn=lossy_verify)
    pval = chi2_pvalue(joint_counts(lossy), joint, "lossy")
    assert pval < P_LOSSY, pval


def test_seeded_speculative_equals_seeded_autoregressive():
  # Keys depend only on (seed, position), so the speculative output equals plain seeded target
  # sampling token for token (float32; identical logits rows, so no near-tie exemption needed).
  target, drafter = micro_model()
  n, num_tokens = 600, 6
  sampling = vf.SamplingParams.make(
      n, temperature=np.tile([0.0, 1.0, 0.7], n // 3), top_k=np.tile([0, 0, 4], n // 3),
      top_p=np.tile([1.0, 0.9, 1.0], n // 3), seed=np.arange(n) * 7919)
  ar = np.zeros((n, num_tokens), np.int32)
  prev = np.full(n, ROOT, np.int32)
  for pos in range(num_tokens):  # the token at position pos + 1, drawn from the node at pos
    logits = jnp.asarray(target[prev])[:, None, :]
    prev = np.asarray(draw_jit(logits, jnp.full((n, 1), pos, jnp.int32), sampling))[:, 0]
    ar[:, pos] = prev
  # Trees of budget 2 (mixed shapes, Q = 3) and a plain budget-1 chain (Q = 2).
  for shapes in (SHAPES, SHAPES[:1, :2]):
    spec, accepted, _ = speculate(target, drafter, sampling, num_tokens, seed=1, shapes=shapes)
    np.testing.assert_array_equal(spec, ar)
    assert accepted.mean() > 0.4
  # Sampled rows leave the greedy path: for rows 1::3 (T = 1, top-p 0.9) with probability 0.294
  # (exact, from the micro model), 200 rows: sd 0.032, so 0.15 is 4.5 sd below.
  assert np.mean(np.any(ar[1::3] != ar[0], axis=1)) > 0.15


# ---------------------------------------------------------------- jit vs eager, bad input


def test_jit_equals_disable_jit():
  rng = np.random.default_rng(11)
  batch, q_len, vocab = 12, 6, 8
  tree, _ = random_trees(rng, batch, q_len, vocab=4)
  logits = jnp.asarray(rng.normal(size=(batch, q_len, vocab)) * 2, jnp.float32)
  # Give drafted tokens a high logit at their parent so paths get accepted.
  tok = np.asarray(tree.tokens)
  par = np.asarray(tree.parents)
  boost = np.zeros((batch, q_len, vocab), np.float32)
  for b in range(batch):
    for i in range(1, q_len):
      if par[b, i] >= 0:
        boost[b, par[b, i], tok[b, i]] = 4.0
  logits = logits + boost
  sampling = vf.SamplingParams.make(
      batch, temperature=rng.choice([0.0, 0.6, 1.0], batch), top_k=rng.choice([0, 3], batch),
      top_p=rng.choice([1.0, 0.8], batch), seed=rng.integers(0, 2**32, batch, dtype=np.uint64))
  stop_tokens = jnp.asarray(rng.integers(0, vocab, (batch, 3)), jnp.int32)
  stop_valid = jnp.asarray(rng.random((batch, 3)) < 0.5)
  compiled = verify_jit(logits, tree, sampling, stop_tokens, stop_valid)
  with jax.disable_jit():
    eager = vf.verify(logits, tree, sampling, stop_tokens, stop_valid)
    drawn = vf.draw_tokens(logits, tree.positions, sampling)  # eager ops already compiled: cheap
  jax.tree.map(np.testing.assert_array_equal, compiled, eager)
  assert int(jnp.max(compiled.num_accepted)) >= 2
  check_against_ref(compiled, tree, drawn, stop_tokens, stop_valid)


def test_verify_invalid_root_rows_emit_nothing():
  tree = build_tree([[-1, 0], [-1, -1]], [[2, 1], [2, 1]], valid=[[1, 1], [0, 0]])
  logits = jnp.zeros((2, 2, 4)).at[:, :, 1].set(5.0)
  res = verify_jit(logits, tree, vf.SamplingParams.make(2, temperature=[0.0, 1.0]))
  np.testing.assert_array_equal(res.num_emitted, [2, 0])
  np.testing.assert_array_equal(res.num_accepted, [2, 0])
  assert not bool(jnp.any(res.hit_stop))


@pytest.mark.parametrize("kwargs,name", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": [0.5, -0.1, 1.0]}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -3}, "seed"),
    ({"temperature": [1.0, 1.0]}, "temperature"),  # wrong length
])
def test_sampling_params_rejects_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    vf.SamplingParams.make(3, **kwargs)


def test_sampling_params_make_broadcasts():
  s = vf.SamplingParams.make(3, temperature=[0.0, 0.5, 1.0], top_k=2, top_p=0.9, seed=2**32 - 1)
  assert s.temperature.dtype == jnp.float32 and s.top_k.dtype == jnp.int32
  np.testing.assert_array_equal(s.top_k, [2, 2, 2])
  np.testing.assert_array_equal(s.seed, [2**32 - 1] * 3)
  assert s.batch_size == 3
