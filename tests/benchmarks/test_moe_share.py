"""``benchmarks/moe_share.py``: its cells hold bench_moe's routings restricted to the share, and
``time_variants`` times the variants of a cell in turn and keeps each one's rows and kernels."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def share():
  return load_benchmark("moe_share")


def test_pair_cell_holds_one_token_per_routing_with_other_shares_experts_as_e(share):
  bench = share.bench
  cell = share.pair_cell(48)
  assert len(cell.calls) == bench.ROUTINGS and cell.expected_rows == 1
  ids = np.stack([np.asarray(i) for _, i in cell.calls])  # [routings, 1, 8]
  assert all(x.shape == (1, bench.HIDDEN) and x.dtype == jnp.bfloat16 for x, _ in cell.calls)
  assert ids.shape == (bench.ROUTINGS, 1, 8) and ids.min() >= 0 and ids.max() <= 48
  live = [len(set(row[row < 48].tolist())) for row in ids[:, 0]]
  assert cell.touched == pytest.approx(np.mean(live)) and 0 < cell.touched < 8
  assert share.pair_cell(96).expected_rows == 2


def test_sorted_cell_holds_t_tokens_rows_and_the_shares_group_sizes(share):
  bench = share.bench
  cell = share.sorted_cell(48, 9)
  assert cell.expected_rows == 9  # 72 rows x 48 / 384
  for x, g in cell.calls:
    assert x.shape == (72, bench.HIDDEN) and g.shape == (48,) and 0 < int(g.sum()) <= 72
  assert cell.touched == pytest.approx(np.mean([int((np.asarray(g) > 0).sum()) for _, g in cell.calls]))


def test_time_variants_takes_turns_and_keeps_each_variants_rows(share, monkeypatch):
  bench = share.bench
  order, clock = [], itertools.count(1)

  def fake_device_in_step(step, calls, w, repeats=5):
    name = step.__name__
    order.append(name)
    return float(next(clock)), {f"{name}_mosaic_gpu_kernel": 1.5, "loop_add_fusion": 0.2}

  def fake_in_step(layer):
    def step(xs, gs, w):
      return [layer(x, g, w) for x, g in zip(xs, gs)]
    step.__name__ = layer.__name__
    return step

  monkeypatch.setattr(bench, "device_in_step", fake_device_in_step)
  monkeypatch.setattr(bench, "in_step", fake_in_step)

  def double(x, g, w):
    return x * 2

  def shift(x, g, w):
    return x + w

  calls = [(jnp.full((1, 4), float(i)), None) for i in range(3)]
  cell = share.Cell(calls, 1.0, 1)
  timed = share.time_variants({"double": double, "shift": shift}, cell, jnp.float32(1), repeats=3)
  assert order == ["double", "shift"] * 3  # in turn, not one variant's repeats in a row
  assert timed["double"].gpu_us == 3.0 and timed["shift"].gpu_us == 4.0  # medians of 1, 3, 5 and 2, 4, 6
  assert timed["double"].kernels == {"double_mosaic_gpu_kernel": 1.5}  # Mosaic GPU kernels only
  np.testing.assert_array_equal(timed["double"].rows, np.arange(3.0)[:, None, None] * 2 * np.ones((3, 1, 4)))
  np.testing.assert_array_equal(timed["shift"].rows, np.arange(3.0)[:, None, None] + np.ones((3, 1, 4)))
