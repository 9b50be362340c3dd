"""``benchmarks/moe_prefill_rows.py``: its variants call the rows and tiles they name, its routings
are the model's sorted rows, its table puts each measurement in its row, and it refuses to run off
the GPU."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("moe_prefill_rows")


def test_variants_call_the_rows_and_tiles_they_name(bench, monkeypatch):
  seen = []
  monkeypatch.setattr(moe, "moe_experts", lambda x, g, w, **kw: seen.append((g, kw)))
  for options in bench.variants().values():
    bench.layer(85, **options)(None, ("sizes", "ids"), None)
  assert [g for g, _ in seen] == ["sizes"] * 3
  got = [(kw["expected_rows"], kw["sorted_expert_ids"], kw.get("block_rows"), kw.get("tiles")) for _, kw in seen]
  assert got == [(85, "ids", 64, None), (85, "ids", 128, moe.BF16_TILES), (85, "ids", None, None)]
  assert bench.variants([16, 32]) == {"16 rows": dict(block_rows=16), "32 rows": dict(block_rows=32)}


def test_calls_are_sorted_rows_with_their_experts(bench):
  """The share keeps its experts' rows in expert order, the rest sort last as padding (id E); the
  counts are those of the ids."""
  for experts in (384, 48):
    (x, (sizes, ids)), = bench.calls(3, experts, routings=1, seed=2)
    sizes, ids = np.asarray(sizes), np.asarray(ids)
    assert x.shape == (24, bench.bench.HIDDEN) and x.dtype == jnp.bfloat16 and ids.shape == (24,)
    assert (np.diff(ids) >= 0).all() and ids.max() <= experts
    np.testing.assert_array_equal(sizes, np.bincount(ids, minlength=experts + 1)[:experts])
    assert sizes.sum() == (24 if experts == 384 else (ids < experts).sum())


def test_markdown_rows(bench):
  rows = [dict(experts=384, tokens=4096, rows_per_expert=85.3, variant="64 rows", block_rows=64, touched=384.0,
               gpu_us=14248.0, roofline_us=7436.0, roofline_fraction=7436 / 14248,
               kernels={"moe_gate_up_mosaic_gpu_kernel": 8734.7}, vs_first=1.0, same_rows=True),
          dict(experts=48, tokens=4096, rows_per_expert=85.3, variant="default", block_rows=128, touched=48.0,
               gpu_us=1396.0, roofline_us=930.0, roofline_fraction=930 / 1396,
               kernels={"moe_down_mosaic_gpu_kernel": 396.7}, vs_first=0.69, same_rows=False)]
  text = bench.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, repeats=3,
                             routings=4, rows=rows))
  lines = text.splitlines()
  assert "| 384 | 4096 | 85 | 64 rows | 64 | 14248 | 52.2% | moe_gate_up 8734.7 | 1.000x | yes |" in lines
  assert "| 48 | 4096 | 85 | default | 128 | 1396 | 66.6% | moe_down 396.7 | 0.690x | **no** |" in lines
  assert bench.cell(rows[1]) == (48, 4096, 128, "default")


def test_bad_options_are_refused_by_name(bench, monkeypatch, capsys):
  with pytest.raises(SystemExit):
    run_main(monkeypatch, bench, "--routings", "0")
  assert "--routings must be >= 1, got 0" in capsys.readouterr().err
  for bad in ("24", "256"):
    with pytest.raises(SystemExit):
      run_main(monkeypatch, bench, "--rows", "16", bad)
    assert f"--rows: {bad} is not a multiple of 16 in [16, 128]" in capsys.readouterr().err
  for flag, bad, message in (("--experts", "385", "--experts: 385 is not in [1, 384]"),
                             ("--experts", "0", "--experts: 0 is not in [1, 384]"),
                             ("--tokens", "0", "--tokens: 0 must be >= 1")):
    with pytest.raises(SystemExit):
      run_main(monkeypatch, bench, flag, bad)
    assert message in capsys.readouterr().err


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))


def test_main_times_each_variant_and_compares_rows_with_the_first(bench, tmp_path, monkeypatch):
  """The script's glue on the CPU, with the kernel and the timing faked: a row per (E, T, variant),
  the roofline from the touched experts, times against ``64 rows``, and a variant whose rows differ
  reported as such."""
  timing = bench.bench
  monkeypatch.setattr(bench.results_io, "require_gpu", lambda script: None)
  monkeypatch.setattr(timing, "ceilings", lambda: {"stream_read_bytes_per_s": 4e12})
  monkeypatch.setattr(timing, "make_bf16", lambda key, experts: None)
  monkeypatch.setattr(timing, "HIDDEN", 8)

  def fake_layer(expected_rows, **options):
    shift = 1.0 if options.get("tiles") is moe.BF16_TILES else 0.0  # "128 rows, BF16_TILES" differs
    return lambda x, g, w: x + shift
  monkeypatch.setattr(bench, "layer", fake_layer)
  clock = iter(range(1000))
  monkeypatch.setattr(timing, "device_in_step", lambda step, calls, w: (100.0 + next(clock) % 3, {"k_mosaic_gpu": 1.0}))
  run_main(monkeypatch, bench, "--out", str(tmp_path), "--experts", "48", "--tokens", "6", "--routings", "2",
           "--repeats", "3")
  result = json.loads((tmp_path / "moe_prefill_rows.json").read_text())
  rows = result["rows"]
  assert result["repeats"] == 3 and result["routings"] == 2
  assert [r["variant"] for r in rows] == list(bench.variants())
  assert [r["same_rows"] for r in rows] == [True, False, True]
  assert [r["block_rows"] for r in rows] == [64, 128, moe.default_block_rows(48, 6, is_int4=False)]
  # Timed in turn: 64 rows takes clock ticks 0, 3, 6 (100 us each), 128 rows 1, 4, 7 (101), default 102.
  assert [r["gpu_us"] for r in rows] == [100.0, 101.0, 102.0]
  assert rows[1]["vs_first"] == pytest.approx(1.01)
  touched = rows[0]["touched"]
  assert 0 < touched <= 48 and rows[0]["roofline_us"] == pytest.approx(timing.weight_bytes("bf16", touched) / 4e12 * 1e6)
  assert (tmp_path / "moe_prefill_rows.md").read_text().count("\n| 48 | 6 |") == 3
  run_main(monkeypatch, bench, "--out", str(tmp_path), "--experts", "48", "--tokens", "6", "--routings", "1",
           "--repeats", "1", "--rows", "16", "32", "--name", "rows")
  rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert [(r["variant"], r["block_rows"], r["same_rows"]) for r in rows] == [("16 rows", 16, True), ("32 rows", 32, True)]
