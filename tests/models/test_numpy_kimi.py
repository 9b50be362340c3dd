"""Self-checks of the float64 numpy Kimi reference (tests/models/numpy_kimi.py). CPU, float64."""

import math

import numpy as np
import pytest

from models.config import KimiConfig
from tests.models import numpy_kimi as nk

TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def cfg():
  return KimiConfig.tiny()


@pytest.fixture(scope="module")
def state(cfg):
  return nk.init_random_state(cfg, seed=0)


def _tokens(cfg, s, seed=1):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=s)


# ---- (a) RoPE: HF permute + rotate_half == direct interleaved-pair rotation ------------------------
def _rope_interleaved(x, positions, inv_freq, scale):
  """Rotate each pair (x[2i], x[2i+1]) by angle pos * inv_freq[i]; keep the interleaved layout."""
  out = np.empty_like(x)
  for t, pos in enumerate(positions):
    for i, f in enumerate(inv_freq):
      a = pos * f
      c, s = math.cos(a) * scale, math.sin(a) * scale
      x0, x1 = x[t, ..., 2 * i], x[t, ..., 2 * i + 1]
      out[t, ..., 2 * i] = x0 * c - x1 * s
      out[t, ..., 2 * i + 1] = x0 * s + x1 * c
  return out


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_rope_hf_equals_interleaved_rotation(factor):
  cfg = KimiConfig.tiny(rope_factor=factor)
  rng = np.random.default_rng(0)
  d = cfg.qk_rope_head_dim
  positions = rng.integers(0, 5000, size=7)
  q = rng.standard_normal((7, cfg.num_attention_heads, d))
  k = rng.standard_normal((7, d))
  cos, sin = nk.rope_cos_sin(cfg, positions)
  q_hf, k_hf = nk.apply_rope_hf(q, cos, sin), nk.apply_rope_hf(k, cos, sin)
  scale = (0.1 * 1.0 * math.log(factor) + 1) / (0.1 * 0.707 * math.log(factor) + 1) if factor > 1 else 1.0
  inv_freq = nk.rope_inv_freq(cfg)
  q_il = _rope_interleaved(q, positions, inv_freq, scale)
  k_il = _rope_interleaved(k, positions, inv_freq, scale)
  # The HF result is the interleaved one in the halves layout: evens first, then odds.
  perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
  np.testing.assert_allclose(q_hf, q_il[..., perm], **TOL)
  np.testing.assert_allclose(k_hf, k_il[..., perm], **TOL)
  # Hence every q.k score agrees across the two layouts.
  np.testing.assert_allclose(np.einsum("qhd,kd->hqk", q_hf, k_hf),
                             np.einsum("qhd,kd->hqk", q_il, k_il), **TOL)


# ---- (b) inv_freq: plain RoPE at factor 1, hand-computed YaRN ramps ------------------------------
def test_inv_freq_plain_rope_without_yarn():
  cfg = KimiConfig.tiny(rope_factor=1.0)
  d = cfg.qk_rope_head_dim
  want = np.array([50000.0**(-2 * i / d) for i in range(d // 2)])
  np.testing.assert_allclose(nk.rope_inv_freq(cfg), want, rtol=1e-14)
  assert nk.attn_softmax_scale(cfg) == pytest.approx(24**-0.5, rel=1e-15)
  cos, sin = nk.rope_cos_sin(cfg, np.array([0, 3]))
  np.testing.assert_allclose(cos[0], 1.0)
  np.testing.assert_allclose(sin[0], 0.0)
  np.testing.assert_allclose(cos[1, 0], math.cos(3.0), rtol=1e-14)


def test_yarn_tiny_by_hand(cfg):
  # dim 8, theta 5e4, 32 original positions, beta_fast 32, beta_slow 1:
  #   dim(32) = 8 ln(32 / (64 pi)) / (2 ln 5e4) = -0.679 -> floor -1 -> clamped to 0
  #   dim(1)  = 8 ln(32 / (2 pi))  / (2 ln 5e4) =  0.602 -> ceil 1
  # ramp = clip(i / 1, 0, 1) = [0, 1, 1, 1]: pair 0 keeps theta^0, pairs 1..3 interpolate (/ factor 4).
  assert nk.yarn_correction_range(cfg) == (0, 1)
  np.testing.assert_array_equal(nk.yarn_linear_ramp(0, 1, 4), [0.0, 1.0, 1.0, 1.0])
  want = [1.0, 1 / (4 * 50000**0.25), 1 / (4 * 50000**0.5), 1 / (4 * 50000**0.75)]
  np.testing.assert_allclose(nk.rope_inv_freq(cfg), want, rtol=1e-14)
  # Scales: m(4, 1) = 1 + 0.1 ln 4 = 1.1386294; m(4, 0.707) = 1 + 0.0707 ln 4 = 1.0980110.
  assert nk.attn_softmax_scale(cfg) == pytest.approx(24**-0.5 * 1.0980110**2, rel=1e-7)
  cos, _ = nk.rope_cos_sin(cfg, np.array([0]))
  np.testing.assert_allclose(cos[0], 1.1386294 / 1.0980110, rtol=1e-7)
  # Cross-check against config.py's own (separately written) properties.
  assert nk.attn_softmax_scale(cfg) == pytest.approx(cfg.softmax_scale, rel=1e-14)
  assert cos[0, 0] == pytest.approx(cfg.rope_cos_sin_scale, rel=1e-14)


def test_yarn_k2_6_by_hand():
  cfg = KimiConfig.k2_6()
  # dim(1) = 64 ln(4096 / (2 pi)) / (2 ln 5e4) = 19.16 -> low 19, high 20 (beta_fast = beta_slow = 1)
  assert nk.yarn_correction_range(cfg) == (19, 20)
  inv = nk.rope_inv_freq(cfg)
  extra = 50000.0**(-np.arange(0, 64, 2) / 64)
  np.testing.assert_allclose(inv[:20], extra[:20], rtol=1e-14)  # ramp 0 up to index 19
  np.testing.assert_allclose(inv[20:], extra[20:] / 64, rtol=1e-14)  # ramp 1 from index 20
  # m(64, 1) = 1 + 0.1 ln 64 = 1.41589; scale = 192^-0.5 * m^2 = 0.14468
  assert nk.attn_softmax_scale(cfg) == pytest.approx(192**-0.5 * (1 + 0.1 * math.log(64))**2, rel=1e-14)
  assert nk.attn_softmax_scale(cfg) == pytest.approx(0.1447, abs=1e-4)


def test_linear_ramp_equal_bounds():
  np.testing.assert_allclose(nk.yarn_linear_ramp(2, 2, 4), [0.0, 0.0, 0.0, 1.0])


# ---- (c) causality ---------------------------------------------------------------------------------
def test_causality(cfg, state):
  toks = _tokens(cfg, 12)
  base = nk.forward(state, cfg, toks)
  assert base.shape == (12, cfg.vocab_size) and base.dtype == np.float64
  assert np.all(np.isfinite(base))
  t = 6
  changed = toks.copy()
  changed[t + 1:] = _tokens(cfg, 12 - t - 1, seed=9)
  assert not np.array_equal(changed, toks)
  other = nk.forward(state, cfg, changed)
  np.testing.assert_allclose(other[:t + 1], base[:t + 1], rtol=1e-12, atol=1e-12)
  assert not np.allclose(other[t + 1:], base[t + 1:])
  # A prefix run alone gives the same rows.
  np.testing.assert_allclose(nk.forward(state, cfg, toks[:t + 1]), base[:t + 1], rtol=1e-12, atol=1e-12)


# ---- (d) explicit causal mask == default -----------------------------------------------------------
def test_explicit_causal_mask(cfg, state):
  toks = _tokens(cfg, 10)
  mask = np.tril(np.ones((10, 10), dtype=bool))
  np.testing.assert_array_equal(nk.forward(state, cfg, toks, mask=mask), nk.forward(state, cfg, toks))
  # A different mask does change the logits (the mask is actually used).
  full = np.ones((10, 10), dtype=bool)
  assert not np.allclose(nk.forward(state, cfg, toks, mask=full)[:-1], nk.forward(state, cfg, toks)[:-1])


def test_all_masked_row_rejected(cfg, state):
  mask = np.tril(np.ones((4, 4), dtype=bool))
  mask[2] = False
  with pytest.raises(ValueError):
    nk.forward(state, cfg, _tokens(cfg, 4), mask=mask)


# ---- (e) RoPE relative-position invariance (YaRN included) -----------------------------------------
@pytest.mark.parametrize("shift", [5, 37, 1000])
def test_position_shift_invariance(cfg, state, shift):
  toks = _tokens(cfg, 9)
  base = nk.forward(state, cfg, toks)
  shifted = nk.forward(state, cfg, toks, positions=np.arange(9) + shift)
  np.testing.assert_allclose(shifted, base, rtol=1e-9, atol=1e-9)


def test_single_token_position_free(cfg, state):
  """One token attending only itself: its logits do not depend on its position."""
  tok = _tokens(cfg, 1)
  base = nk.forward(state, cfg, tok, positions=np.array([0]))
  for p in (1, 31, 32, 777, 4000):
    np.testing.assert_allclose(nk.forward(state, cfg, tok, positions=np.array([p])), base,
                               rtol=1e-9, atol=1e-9)
  # Same with a diagonal mask over a sequence: every row equals its own single-token run.
  toks = _tokens(cfg, 6)
  diag = nk.forward(state, cfg, toks, positions=np.arange(6) * 13, mask=np.eye(6, dtype=bool))
  for i in range(6):
    np.testing.assert_allclose(diag[i], nk.forward(state, cfg, toks[i:i + 1])[0], rtol=1e-9, atol=1e-9)


def test_positions_matter(cfg, state):
  toks = _tokens(cfg, 6)
  spread = nk.forward(state, cfg, toks, positions=np.array([0, 1, 2, 3, 4, 50]))
  base = nk.forward(state, cfg, toks)
  np.testing.assert_allclose(spread[:5], base[:5], rtol=1e-12, atol=1e-12)
  assert not np.allclose(spread[5], base[5])


# ---- tree mask: a node sees exactly its ancestors --------------------------------------------------
def test_tree_mask_matches_path_runs(cfg, state):
  #        0 (pos 10)
  #       / \
  #  1 (11)  2 (11)
  #   |       |
  #  3 (12)  4 (12)
  #   |
  #  5 (13)
  parent = [-1, 0, 0, 1, 2, 3]
  depth = [0, 1, 1, 2, 2, 3]
  n = len(parent)
  prefix = _tokens(cfg, 10, seed=3)
  tree = _tokens(cfg, n, seed=4)
  mask = np.zeros((10 + n, 10 + n), dtype=bool)
  mask[:10, :10] = np.tril(np.ones((10, 10), dtype=bool))
  mask[10:, :10] = True
  for i in range(n):
    j = i
    while j >= 0:
      mask[10 + i, 10 + j] = True
      j = parent[j]
  positions = np.concatenate([np.arange(10), 10 + np.array(depth)])
  logits = nk.forward(state, cfg, np.concatenate([prefix, tree]), positions=positions, mask=mask)
  for i in range(n):
    path, j = [], i
    while j >= 0:
      path.append(j)
      j = parent[j]
    path = path[::-1]
    seq = np.concatenate([prefix, tree[path]])
    ref = nk.forward(state, cfg, seq)  # positions 0..10+depth, causal
    np.testing.assert_allclose(logits[10 + i], ref[-1], rtol=1e-10, atol=1e-10)


# ---- hidden states ---------------------------------------------------------------------------------
def test_hidden_states(cfg, state):
  toks = _tokens(cfg, 5)
  logits, hidden = nk.forward(state, cfg, toks, return_hidden=True)
  assert len(hidden) == cfg.num_hidden_layers
  assert all(h.shape == (5, cfg.hidden_size) for h in hidden)
  last = nk.rms_norm(hidden[-1], state["model.norm.weight"], cfg.rms_norm_eps)
  np.testing.assert_allclose(last @ state["lm_head.weight"].astype(np.float64).T, logits, rtol=1e-12)
  # Layer outputs differ from one another (each layer contributes).
  assert not np.allclose(hidden[0], hidden[1])


# ---- (f) MoE routing -------------------------------------------------------------------------------
def test_route_bias_selects_but_does_not_weigh(cfg):
  rng = np.random.default_rng(0)
  E, H, k = cfg.n_routed_experts, cfg.hidden_size, cfg.num_experts_per_tok
  x = rng.standard_normal((20, H))
  gate = rng.standard_normal((E, H)) / math.sqrt(H)
  gate[5] -= 3 * x.mean(0) / np.linalg.norm(x.mean(0))  # make expert 5's raw score low
  bias = np.zeros(E)
  bias[5] = 1e6
  ids, w = nk.route(x, gate, bias, cfg)
  scores = 1 / (1 + np.exp(-(x @ gate.T)))
  assert np.all(ids[:, 0] == 5)
  for r in range(20):
    others = [e for e in range(E) if e != 5]
    best = others[int(np.argmax(scores[r, others]))]
    assert ids[r, 1] == best
    s5, sb = scores[r, 5], scores[r, best]
    np.testing.assert_allclose(w[r], np.array([s5, sb]) / (s5 + sb + 1e-20) * 2.827, rtol=1e-13)
  assert k == 2
  # Weights always sum to routed_scaling_factor when normalised.
  np.testing.assert_allclose(w.sum(-1), 2.827, rtol=1e-13)
  # Without normalisation they are the raw unbiased scores times the scale.
  ids_raw, w_raw = nk.route(x, gate, bias, cfg.replace(norm_topk_prob=False))
  np.testing.assert_array_equal(ids_raw, ids)
  np.testing.assert_allclose(w_raw, np.take_along_axis(scores, ids, -1) * 2.827, rtol=1e-13)


def test_route_tie_break_lowest_id(cfg):
  E = cfg.n_routed_experts
  x = np.zeros((3, cfg.hidden_size))  # every raw score is sigmoid(0) = 0.5
  ids, w = nk.route(x, np.ones((E, cfg.hidden_size)), np.zeros(E), cfg)
  np.testing.assert_array_equal(ids, [[0, 1]] * 3)
  bias = np.zeros(E)
  bias[[3, 6]] = 0.25
  ids, _ = nk.route(x, np.ones((E, cfg.hidden_size)), bias, cfg)
  np.testing.assert_array_equal(ids, [[3, 6]] * 3)


def test_forward_bias_forces_expert(cfg, state):
  toks = _tokens(cfg, 11)
  load = nk.expert_load(state, cfg, toks)
  assert load.shape == (cfg.num_moe_layers, cfg.n_routed_experts)
  np.testing.assert_array_equal(load.sum(-1), 11 * cfg.num_experts_per_tok)
  np.testing.assert_array_equal(nk.expert_load(state, cfg, toks, valid=np.arange(11) < 4).sum(-1),
                                4 * cfg.num_experts_per_tok)
  base = nk.forward(state, cfg, toks)
  # Pick, for the first MoE layer, an expert no token chose, and force it with a huge bias.
  e = int(np.argmin(load[0]))
  assert load[0, e] < 11
  forced = dict(state)
  name = f"model.layers.{cfg.first_k_dense_replace}.mlp.gate.e_score_correction_bias"
  forced[name] = state[name].copy()
  forced[name][e] = 1e6
  load2 = nk.expert_load(forced, cfg, toks)
  assert np.all(load2[0, e] == 11)
  assert not np.allclose(nk.forward(forced, cfg, toks), base)
  # Adding the same constant to every bias changes nothing (selection is by order, weights unbiased).
  shifted = dict(state)
  shifted[name] = state[name] + 100.0
  np.testing.assert_allclose(nk.forward(shifted, cfg, toks), base, rtol=1e-12, atol=1e-12)


def test_moe_layer_by_hand(cfg, state):
  """The MoE block equals an explicit per-token loop over its chosen experts plus the shared one."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal((4, cfg.hidden_size))
  p = f"model.layers.{cfg.first_k_dense_replace}.mlp."
  get = lambda n: state[n].astype(np.float64)
  out, ids = nk.moe(get, p, cfg, x)

  def mlp(prefix, v):
    g = get(prefix + "gate_proj.weight") @ v
    u = get(prefix + "up_proj.weight") @ v
    return get(prefix + "down_proj.weight") @ (g / (1 + np.exp(-g)) * u)

  for t in range(4):
    logits = get(p + "gate.weight") @ x[t]
    sc = 1 / (1 + np.exp(-logits))
    biased = sc + get(p + "gate.e_score_correction_bias")
    top = sorted(range(cfg.n_routed_experts), key=lambda e: (-biased[e], e))[:cfg.num_experts_per_tok]
    assert list(ids[t]) == top
    w = sc[top] / (sc[top].sum() + 1e-20) * cfg.routed_scaling_factor
    want = sum(wi * mlp(f"{p}experts.{e}.", x[t]) for wi, e in zip(w, top)) + mlp(p + "shared_experts.", x[t])
    np.testing.assert_allclose(out[t], want, rtol=1e-12, atol=1e-12)


def test_per_token_independence(cfg, state):
  """Dropless MoE: a token's MoE output does not depend on the other rows of the batch."""
  rng = np.random.default_rng(6)
  x = rng.standard_normal((9, cfg.hidden_size))
  p = f"model.layers.{cfg.first_k_dense_replace}.mlp."
  get = lambda n: state[n].astype(np.float64)
  full, _ = nk.moe(get, p, cfg, x)
  for t in range(9):
    one, _ = nk.moe(get, p, cfg, x[t:t + 1])
    np.testing.assert_allclose(one[0], full[t], rtol=1e-12, atol=1e-12)


def test_state_names_and_layouts(cfg, state):
  H = cfg.hidden_size
  a = "model.layers.0.self_attn."
  assert state[a + "q_b_proj.weight"].shape == (cfg.num_attention_heads * 24, cfg.q_lora_rank)
  assert state[a + "kv_a_proj_with_mqa.weight"].shape == (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
  assert state[a + "kv_b_proj.weight"].shape == (cfg.num_attention_heads * 32, cfg.kv_lora_rank)
  assert state[a + "o_proj.weight"].shape == (H, cfg.num_attention_heads * cfg.v_head_dim)
  assert "model.layers.0.mlp.gate_proj.weight" in state
  assert "model.layers.0.mlp.gate.weight" not in state
  assert state["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (32, H)
  assert all(v.dtype == np.float32 for v in state.values())
  missing = dict(state)
  del missing["model.layers.2.self_attn.kv_b_proj.weight"]
  with pytest.raises(KeyError):
    nk.forward(missing, cfg, np.arange(4))
