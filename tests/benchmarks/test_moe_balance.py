"""``benchmarks/moe_balance.py`` (an ablation: the INT4 gate/up on balanced programs): its kernel
gives one-program-per-tile rows and tile loads bit for bit in interpret mode, cut tiles included,
lowers for the GPU at K2.6's widths, and the script's table and refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark, run_main
from tests.pallas_kernels import test_moe


@pytest.fixture(scope="module")
def balance():
  return load_benchmark("moe_balance")


# One chunk a pipeline step, so that the small sizes have several: bf16 gate/up K = 224 in 4
# chunks of 64; INT4 K = 544 (padded to 768) in 3 chunks of 256.
CHUNK_TILES = {"bf16": moe.KernelTiles(moe.TileConfig(64, 2, chunk_k=64), moe.TileConfig(64, 2)),
               "int4": moe.KernelTiles(moe.TileConfig(256, 2, chunk_k=256), moe.TileConfig(256, 2))}


# The balancing logic is the same for both formats (INT4 differs only in the dequantised tile, which
# the MoE tests cover); the INT4 case is the heaviest of this ablation's tests, so it runs with -m slow.
@pytest.mark.parametrize("fmt,programs", [("bf16", (3, 7)), pytest.param("int4", (3, 7, 40), marks=pytest.mark.slow)])
def test_balanced_programs_give_one_program_per_tile_bit_for_bit(balance, fmt, programs):
  x, sizes, experts, _ = test_moe.chunk_case(fmt, seed=51)
  g = jnp.asarray(sizes)
  tiles = CHUNK_TILES[fmt]
  want = moe.moe_experts_with_tile_loads(x, g, experts, tiles=tiles, interpret=test_moe.INTERPRET)
  test_moe.assert_close(want[0], test_moe.reference(x, sizes, experts), int(sizes.sum()))
  chunks = int(np.asarray(want[1]).max())  # one step a chunk
  # The kernel's tiles: every (item slot below the list's count, output tile).
  work = moe.work_list(g, x.shape[0], moe.default_block_rows(len(sizes), x.shape[0], is_int4=fmt == "int4"))
  num_tiles = int(work.num_slots[0]) * np.asarray(want[1]).shape[0]
  for p in programs:
    # The counts chosen below the tiles cut some (the fold's path); past them, none is cut.
    _, cut, live = balance.balance_ranges(np.arange(p - 1), num_tiles, chunks, p)
    cuts = int(((np.arange(p - 1) + 1 < live) & (np.asarray(cut) % chunks != 0)).sum())
    assert (cuts > 0) == (p < num_tiles), f"{p} programs, {num_tiles} tiles: {cuts} cut"
    got = balance.balanced_experts(x, g, experts, programs=p, tiles=tiles, interpret=test_moe.INTERPRET,
                                   count_tile_loads=True)
    for a, b, what in zip(got, want, ("rows", "gate/up loads", "down loads")):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"{p}: {what}")


def test_balanced_kernel_lowers_for_cuda_at_kimi_widths(balance):
  e = 48

  def matrix(n, k):
    return moe.KernelInt4Matrix(jax.ShapeDtypeStruct((e, n, k // 8), jnp.uint32),
                                jax.ShapeDtypeStruct((e, n, k // 32), jnp.bfloat16), k)
  experts = moe.Int4Experts(matrix(2048, 7168), matrix(2048, 7168), matrix(7168, 2048))
  x = jax.ShapeDtypeStruct((136, 7168), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((e,), jnp.int32)
  for dequant in ("registers", "registers_serial"):
    fn = jax.jit(lambda x, g, w: balance.balanced_experts(x, g, w, programs=264, expected_rows=17,
                                                          int4_dequant=dequant))
    text = fn.trace(x, g, experts).lower(lowering_platforms=("cuda",)).as_text()
    assert "moe_gate_up" in text and "moe_fold" in text and "moe_down" in text


def test_balanced_kernel_refuses_a_split_or_unchunked_config(balance):
  x, sizes, experts, _ = test_moe.chunk_case("bf16", seed=51)
  for gate_up in (moe.TileConfig(64, 2), moe.TileConfig(64, 2, chunk_k=64, split_k=True)):
    tiles = dataclasses.replace(CHUNK_TILES["bf16"], gate_up=gate_up)
    with pytest.raises(ValueError, match="chunk_k without split_k"):
      balance.balanced_experts(x, jnp.asarray(sizes), experts, programs=4, tiles=tiles,
                               interpret=test_moe.INTERPRET)


def test_markdown_cells(balance):
  rows = [dict(experts=48, tokens=9, touched=8.5, variant="default", dequant="registers", gpu_us=88.4,
               vs_default=1.0, rows="-", kernels={"moe_gate_up_mosaic_gpu_kernel": 54.5}),
          dict(experts=48, tokens=9, touched=8.5, variant="balanced 264", dequant="registers", gpu_us=91.2,
               vs_default=91.2 / 88.4, rows="bit-identical", kernels={"moe_fold_mosaic_gpu_kernel": 3.5})]
  text = balance.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, rows=rows))
  lines = text.splitlines()
  assert "| 48 | 9 | 8.5 | default | registers | 88.4 | 1.00x | moe_gate_up 54.5 | - |" in lines
  assert "| 48 | 9 | 8.5 | balanced 264 | registers | 91.2 | 1.03x | moe_fold 3.5 | bit-identical |" in lines


def test_refuses_to_run_off_the_gpu(balance, monkeypatch):
  with pytest.raises(SystemExit, match="GPU"):
    run_main(monkeypatch, balance)


@pytest.mark.parametrize("args,message", [(("--programs", "0"), "--programs"), (("--cells", "48x9"), "--cells"),
                                          (("--cells", "500:9"), "--cells")])
def test_bad_arguments_are_refused_by_name(balance, monkeypatch, capsys, args, message):
  with pytest.raises(SystemExit):
    run_main(monkeypatch, balance, *args)
  assert message in capsys.readouterr().err
