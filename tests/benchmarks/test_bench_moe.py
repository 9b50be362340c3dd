"""``benchmarks/bench_moe.py``: ``--resume`` (one expert count timed again without the other) and
the routed-block cells' inputs and table."""

import numpy as np
import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("bench_moe")


def row(experts, tokens, fmt, impl, device_us, roofline_us=50.0, **extra):
  return dict(experts=experts, tokens=tokens, format=fmt, impl=impl, distinct_experts=8.0,
              roofline_us=roofline_us, time_us=device_us + 40, roofline_fraction=roofline_us / (device_us + 40),
              device_us=device_us, device_roofline_fraction=roofline_us / device_us,
              device_kernels_us={"moe_gate_up_mosaic_gpu_kernel": device_us / 2}, **extra)


def result(rows, argv, stream=4.6e12):
  return dict(device="gpu", device_kind="NVIDIA H200", jax="0.11.2", python="3.12", argv=argv,
              ceilings=dict(stream_read_bytes_per_s=stream, copy_bytes_per_s=3.3e12, matmul_bf16_flop_per_s=7e14),
              check={}, rows=rows)


def test_resume_keeps_only_cells_not_timed_again_and_names_their_run(bench):
  earlier = result([row(384, 1, "int4", "pallas", 81.0), row(48, 1, "int4", "pallas", 32.0),
                    row(48, 1, "bf16", "ragged_dot", 124.0, run=1)], ["--old"], stream=4.5e12)
  earlier["earlier_runs"] = [dict(argv=["--oldest"], ceilings=earlier["ceilings"], check={})]
  now = result([row(384, 1, "int4", "pallas", 80.0), row(384, 1, "int4", "block_pallas", 78.0),
                row(384, 1, "bf16", "block_ragged_dot", 2983.0), row(384, 1, "bf16", "block_pallas", 176.0)],
               ["--new"])
  bench.resume(now, earlier)
  by = {(r["experts"], r["tokens"], r["format"], r["impl"]): r for r in now["rows"]}
  assert by[(384, 1, "int4", "pallas")]["device_us"] == 80.0  # this run's cell wins
  assert "run" not in by[(384, 1, "int4", "pallas")]
  assert by[(48, 1, "int4", "pallas")]["run"] == 1
  assert by[(48, 1, "bf16", "ragged_dot")]["run"] == 2  # run 1 of the earlier file is run 2 here
  assert [r["argv"] for r in now["earlier_runs"]] == [["--old"], ["--oldest"]]
  text = bench.markdown(now)
  assert "Run 1 (an earlier run; its cells kept where this run did not time them: E=48 pallas)" in text
  assert "`PYTHONPATH=. python3 benchmarks/bench_moe.py --old`" in text
  block = text.split("## The model's routed block, 384 experts")[1]
  # T, distinct, pallas bf16 block, of roofline, experts alone (bf16: none), INT4 block, of
  # roofline, experts alone (INT4 pallas: 80), ragged_dot block, ragged_dot / pallas
  assert "| 1 | 8.0 | 176 | 28% | - | 78 | 64% | 80 | 2983 | 16.9x |" in block


def test_block_inputs_are_the_cells_routing_and_cached(bench, monkeypatch):
  monkeypatch.setattr(bench, "HIDDEN", 16)
  data = {(384, 3): bench.routings(3, 384, seed=7)}
  sets = bench.cell_inputs(data, "block_pallas", 384, 3)
  assert bench.cell_inputs(data, "block_ragged_dot", 384, 3) is sets  # one draw for both paths
  assert bench.cell_inputs(data, "pallas", 384, 3) is data[(384, 3)]
  for (x_sorted, sizes, touched, ids), (tokens, (block_ids, weights), block_touched, _) in zip(data[(384, 3)], sets):
    assert tokens.shape == (3, 16) and block_touched == touched
    np.testing.assert_array_equal(np.asarray(block_ids), ids)
    # The sorted-rows cells' group sizes are these ids' counts: the same experts in both forms.
    np.testing.assert_array_equal(np.bincount(ids.reshape(-1), minlength=385)[:384], np.asarray(sizes))
    np.testing.assert_allclose(np.asarray(weights).sum(1), 1.0, rtol=1e-6)
  ids_48 = bench.routings(3, 48, seed=7)[0][3]
  assert ids_48.max() <= 48 and (ids_48 == 48).sum() > 0  # other GPUs' experts: padding id E


def test_resume_keeps_an_earlier_timing_where_this_run_failed(bench):
  earlier = result([row(384, 136, "bf16", "ragged_dot", 51000.0),
                    dict(experts=384, tokens=544, format="bf16", impl="ragged_dot", distinct_experts=384.0,
                         roofline_us=7000.0, error="JaxRuntimeError: RESOURCE_EXHAUSTED")], ["--old"])
  failed = dict(experts=384, tokens=136, format="bf16", impl="ragged_dot", distinct_experts=362.9,
                roofline_us=7000.0, error="skipped: benchmark deadline")
  now = result([failed, row(384, 544, "bf16", "ragged_dot", 210000.0)], ["--new"])
  bench.resume(now, earlier)
  by = {(r["tokens"], r["impl"]): r for r in now["rows"]}
  assert len(now["rows"]) == 2
  assert by[(136, "ragged_dot")]["device_us"] == 51000.0 and by[(136, "ragged_dot")]["run"] == 1
  assert by[(544, "ragged_dot")]["device_us"] == 210000.0  # this run's timing beats an earlier error


def test_checks_come_from_the_newest_run_that_made_them(bench):
  # A run that times only the block cells cannot check pallas against ragged_dot (nor the row-id
  # work list): the table then shows the earlier run's checks, labelled with their run.
  now = result([row(384, 1, "bf16", "block_pallas", 180.0)], ["--new"])
  now["check"] = {"error": "KeyError: (384, 17, 'bf16', 'pallas')",
                  "block_pallas bf16 E=384 T=1 rel L2 vs block_ragged_dot": 5.1e-3}
  now["earlier_runs"] = [
      dict(argv=["--old"], ceilings=now["ceilings"],
           check={"experts": 384, "tokens": 17, "rel_l2_vs_ragged_dot": 4.9e-3,
                  "block_pallas bf16 E=384 T=1 rel L2 vs block_ragged_dot": 9.9e-3,
                  "pallas_rows int4 E=384 T=1 bit-identical to pallas": True}),
      dict(argv=["--oldest"], ceilings=now["ceilings"],
           check={"experts": 48, "tokens": 17, "rel_l2_vs_ragged_dot": 7.7e-3})]
  text = bench.markdown(now)
  assert "Check at K2.6 size (run 1): pallas bf16 vs ragged_dot relative L2 4.9e-03 (384 experts, T = 17)." in text
  assert "same bf16 weights: block_pallas bf16 E=384 T=1 rel L2 vs block_ragged_dot 5.1e-03." in text
  assert "9.9e-03" not in text and "7.7e-03" not in text
  assert "same routings (run 1): pallas_rows int4 E=384 T=1 bit-identical to pallas: True." in text


def test_per_row_pairs_are_compared_within_one_run(bench):
  """The per-pair cells are set against the sorted path's cells of the same run only, with the
  ratio, and the bit-identity checks are listed."""
  rows = [row(384, 1, "int4", "block_pallas", 70.0, roofline_us=43.0),
          row(384, 1, "int4", "block_pallas_sorted", 80.0, roofline_us=43.0),
          row(384, 1, "int4", "pallas_rows", 68.0, roofline_us=43.0),
          row(384, 1, "int4", "pallas_rows_sorted", 73.0, roofline_us=43.0, run=1)]
  res = result(rows, ["--new"])
  res["earlier_runs"] = [dict(argv=["--old"], ceilings=res["ceilings"], check={})]
  res["check"] = {"per-row block_pallas int4 E=384 T=1 bit-identical to block_pallas_sorted": True}
  text = bench.markdown(res)
  line = next(x for x in text.splitlines() if x.startswith("Per-pair items (one item"))
  assert "block_pallas int4 E=384 T=1 70.0 (61%) vs 80.0 (54%), 0.88x" in line
  assert "pallas_rows int4" not in line  # its sorted cell is from another run
  assert "block_pallas int4 E=384 T=1 bit-identical to block_pallas_sorted: True" in text


def test_reference_checks_take_ragged_dot_else_mgpu_and_report_every_cell(bench):
  """Each (E, T) with the bf16 kernel compiled is checked against ragged_dot where that was compiled,
  else against ragged_dot_mgpu (prefill-sized T); the relative L2 is over the routed rows only."""
  rng = np.random.default_rng(0)
  want = rng.standard_normal((6, 4)).astype(np.float32)
  off = want.copy()
  off[:4] *= 1.01  # 1% off on the 4 routed rows; the 2 padding rows differ wildly and must not count
  off[4:] = 1e3
  sizes = np.array([3, 1, 0])  # 4 routed rows of 6
  data = {(8, 1): [(None, sizes, 0, None)], (8, 2): [(None, sizes, 0, None)], (8, 3): [(None, sizes, 0, None)]}
  weights = {("bf16", 8): None}

  def returning(y):
    return lambda xs, gs, w: [np.asarray(y)]

  def failing(xs, gs, w):
    raise RuntimeError("kernel fault")

  compiled = {(8, 1, "bf16", "pallas"): returning(off), (8, 1, "bf16", "ragged_dot"): returning(want),
              (8, 1, "bf16", "ragged_dot_mgpu"): returning(off),
              (8, 2, "bf16", "pallas"): returning(want), (8, 2, "bf16", "ragged_dot_mgpu"): returning(off),
              (8, 3, "bf16", "pallas"): failing, (8, 3, "bf16", "ragged_dot_mgpu"): returning(want),
              (8, 1, "int4", "pallas"): returning(off)}
  check = bench.reference_checks(compiled, data, weights)
  assert check["pallas bf16 E=8 T=1 rel L2 vs ragged_dot"] == pytest.approx(0.01, rel=1e-4)
  assert check["pallas bf16 E=8 T=2 rel L2 vs ragged_dot_mgpu"] == pytest.approx(0.01 / 1.01, rel=1e-4)
  assert check["pallas bf16 E=8 T=3"] == "RuntimeError: kernel fault"
  assert (check["experts"], check["tokens"]) == (8, 1)
  assert len([k for k in check if k.startswith("pallas bf16")]) == 3  # no INT4 cell: other weights
  text = bench.markdown(result([], ["--x"]) | {"check": check})
  assert "E=8 T=2 rel L2 vs ragged_dot_mgpu 9.9e-03" in text and "E=8 T=3: RuntimeError: kernel fault" in text
  # The summary cell where given and checked against ragged_dot; else the first such cell.
  compiled[(8, 2, "bf16", "ragged_dot")] = returning(want)
  assert (bench.reference_checks(compiled, data, weights, (8, 2))["tokens"],
          bench.reference_checks(compiled, data, weights, (8, 3))["tokens"]) == (2, 1)
