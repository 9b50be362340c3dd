"""``benchmarks/moe_int4_stages.py``: its variants deepen only the rings they name on the default
tiles, its table puts each measurement in its row, bad depths are refused, and it refuses to run
off the GPU."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("moe_int4_stages")


def test_variants_deepen_the_rings_they_name(bench, monkeypatch):
  split = moe.KernelTiles(moe.TileConfig(256, 2, moe.CHUNK_K, True), moe.INT4_TILES.down)
  tiles = bench.tiles_at(split, "4x8")
  assert (tiles.gate_up.stages, tiles.down.stages) == (4, 8)
  assert tiles.gate_up.split_k and tiles.gate_up.chunk_k == moe.CHUNK_K and tiles.gate_up.block_k == 256  # kept
  assert bench.tiles_at(moe.INT4_TILES, bench.DEPTHS[0]) == moe.INT4_TILES  # the first depth is the default's
  seen = []
  monkeypatch.setattr(moe, "moe_experts_per_row", lambda x, i, w, **kw: seen.append(("pairs", kw)))
  monkeypatch.setattr(moe, "moe_experts", lambda x, g, w, **kw: seen.append(("sorted", kw)))
  for tokens in (1, 2):
    bench.layer(tokens, tiles, 3)(jnp.zeros((1, 8)), jnp.zeros((1, 8)), None)
  assert seen == [("pairs", dict(expected_rows=3, tiles=tiles)), ("sorted", dict(expected_rows=3, tiles=tiles))]


def test_bad_arguments_are_refused(bench, monkeypatch, capsys):
  for depth in ("4", "1x2", "ax2", "2x2x2"):
    with pytest.raises(SystemExit):
      run_main(monkeypatch, bench, "--depths", "2x2", depth)
    assert f"--depths {depth!r}: expected gate/up stages x down stages" in capsys.readouterr().err
  for args, message in ((["--depths", "4x4", "2x2"], "--depths must start with the default tiles' 2x2"),
                        (["--tokens", "1", "0"], "--tokens must be >= 1, got 0"),
                        (["--repeats", "0"], "--repeats must be >= 1, got 0")):
    with pytest.raises(SystemExit):
      run_main(monkeypatch, bench, *args)
    assert message in capsys.readouterr().err


def test_markdown_rows(bench):
  rows = [dict(experts=48, tokens=1, touched=0.81, split=True, depth="2x2", gpu_us=14.1, roofline_us=4.4,
               roofline_fraction=4.4 / 14.1, kernels={"moe_fold_mosaic_gpu_kernel": 1.8}, vs_default=1.0,
               rows="bit-identical"),
          dict(experts=48, tokens=9, touched=8.56, split=False, depth="4x8", gpu_us=90.0, roofline_us=46.5,
               roofline_fraction=46.5 / 90.0, kernels={}, vs_default=1.08, rows="DIFFER")]
  lines = bench.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, repeats=5,
                              rows=rows)).splitlines()
  assert "| 1 | 0.81 | yes | 2x2 | 14.1 | 31.2% | moe_fold 1.8 | 1.000x | bit-identical |" in lines
  assert "| 9 | 8.56 | no | 4x8 | 90.0 | 51.7% |  | 1.080x | DIFFER |" in lines


def test_main_times_each_depth_on_the_cells_default_tiles(bench, tmp_path, monkeypatch):
  share, timing = bench.moe_share, bench.bench
  monkeypatch.setattr(bench.results_io, "require_gpu", lambda script: None)
  monkeypatch.setattr(timing, "ceilings", lambda: {"stream_read_bytes_per_s": 4e12})
  monkeypatch.setattr(timing, "make_int4", lambda key, experts: "weights")
  monkeypatch.setattr(share, "pair_cell", lambda experts: share.Cell([], 0.8, 1))
  monkeypatch.setattr(share, "sorted_cell", lambda experts, tokens: share.Cell([], 8.0, tokens))
  splits = {1: True, 9: False}
  monkeypatch.setattr(moe, "default_tiles", lambda w, rows: moe.KernelTiles(
      moe.TileConfig(256, 2, moe.CHUNK_K, splits[rows]), moe.INT4_TILES.down))

  def fake_time_variants(layers, cell, w, repeats):  # 4x2 rounds differently
    assert w == "weights" and repeats == 2
    return {d: share.Timed(10.0 + i, {}, np.full(2, 2.0 if d == "4x2" else 1.0)) for i, d in enumerate(layers)}
  monkeypatch.setattr(share, "time_variants", fake_time_variants)
  run_main(monkeypatch, bench, "--out", str(tmp_path), "--tokens", "1", "9", "--depths", "2x2", "4x2", "2x8",
           "--repeats", "2")
  rows = json.loads((tmp_path / "moe_int4_stages.json").read_text())["rows"]
  assert [(r["tokens"], r["split"], r["depth"], r["rows"]) for r in rows] == [
      (1, True, "2x2", "bit-identical"), (1, True, "4x2", "DIFFER"), (1, True, "2x8", "bit-identical"),
      (9, False, "2x2", "bit-identical"), (9, False, "4x2", "DIFFER"), (9, False, "2x8", "bit-identical")]
  assert rows[2]["vs_default"] == pytest.approx(1.2)


def test_refuses_to_run_off_the_gpu(bench, tmp_path, monkeypatch):
  assert jax.default_backend() != "gpu"
  with pytest.raises(SystemExit, match="run it on the GPU"):
    run_main(monkeypatch, bench, "--out", str(tmp_path))
