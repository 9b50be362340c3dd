"""INT4 gate/up with two compute warpgroups per program against the committed kernel (H200).

    PYTHONPATH=. python3 benchmarks/moe_two_warpgroups.py --out benchmarks/results   # on the GPU

An ablation, not a kernel the package uses. INT4's gate/up programs are bound by dequantising
in registers (one warpgroup, two programs an SM: ``moe_waves.md``). Here a program has two
compute warpgroups, one dequantising and multiplying the gate tile and one the up tile against
the shared x tile, and a memory warpgroup issuing the loads (``emit_pipeline_warp_specialized``);
the up warpgroup hands its sums to the gate warpgroup through shared memory for the SiLU. Each
weight's sum over K is the committed kernel's MMA chain, so the rows must be bit for bit those
of ``moe._grouped_kernel`` with K in one sum (checked first).

Timed as ``moe_waves.py``'s items sweep: the kernel alone on ``n`` live items of 16 rows, every
call on ``n`` distinct random experts of 48, 16 calls in one executable, GPU time from CUPTI;
the committed kernel ("registers" and "registers_serial", ``TileConfig(256, 2)``, one sum) in
the same run. Writes ``moe_two_warpgroups.json`` and ``.md``.
"""

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import bench_moe as bench
import gpu_timing
from pallas_kernels import moe

EXPERTS = 48
ROWS = 16
BLOCK_K = 256
ITEMS = (1, 4, 8, 9, 12, 16, 32, 64)
STAGES = (2, 4, 8)
MAX_STAGES = 8  # 8 x 26.6 KiB of tiles (two weights' words and scales, the x tile) fit shared memory
MEMORY_REGISTERS = 40  # the memory warpgroup only issues copies


def gate_up_two_warpgroups(x, work_expert, block_start, gate: moe.KernelInt4Matrix, up: moe.KernelInt4Matrix,
                           *, stages: int, block_rows: int = ROWS):
  """bf16 [W * R, N] = SiLU(x @ gate) * (x @ up) per work item, as ``moe._grouped_kernel`` (full
  grid, INT4 "registers", K in one sum); item w's rows x[block_start[w] : + R]."""
  r, bk = block_rows, BLOCK_K
  num_experts, n_out, _ = gate.words.shape
  k_steps = pl.cdiv(gate.words.shape[2] * 8, bk)
  x_atom = moe._swizzle_elems(gate.in_features)
  out_atom = moe._swizzle_elems(n_out, moe.TILE_N)

  def body(expert_ref, start_ref, x_ref, gate_words, gate_scale, up_words, up_scale, out_ref,
           up_smem, out_smem, up_ready):
    n, w, wg = lax.axis_index("n"), lax.axis_index("w"), lax.axis_index("wg")
    expert = expert_ref[w]

    @pl.when((expert >= 0) & (expert < num_experts))
    def _():
      in_specs = []
      for _ in range(2):
        in_specs.append(plgpu.BlockSpec((moe.TILE_N, bk // 8), lambda k: (n, k), transforms=moe.WORDS_TRANSFORMS))
        in_specs.append(plgpu.BlockSpec((moe.TILE_N, bk // moe.GROUP_SIZE), lambda k: (n, k)))
      in_specs.append(plgpu.BlockSpec((r, bk), lambda k: (0, k), transforms=moe._bf16_transforms(x_atom)))

      def step(_, gw, gs, uw, us, x_smem, acc):
        pl.when(wg == 0)(lambda: plgpu.wgmma(acc, moe._dequant_words_registers(gw, gs, bk), x_smem.T))
        pl.when(wg == 1)(lambda: plgpu.wgmma(acc, moe._dequant_words_registers(uw, us, bk), x_smem.T))
        plgpu.wgmma_wait(0)
        return acc

      def compute_context(run_pipeline):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((moe.TILE_N, r), jnp.float32))
        def _(acc):
          run_pipeline(acc)
          sums = acc[...]

          @pl.when(wg == 1)
          def _():
            up_smem[...] = sums
            plgpu.barrier_arrive(up_ready)

          @pl.when(wg == 0)
          def _():
            plgpu.barrier_wait(up_ready)
            up_sums = plgpu.layout_cast(up_smem[...], plgpu.Layout.WGMMA)
            out_smem.T[...] = moe._silu_mul(sums, up_sums).astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(w * r, r), pl.ds(n * moe.TILE_N, moe.TILE_N)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(k_steps,), memory_registers=MEMORY_REGISTERS, in_specs=in_specs, wg_axis="wg",
          num_compute_wgs=2, max_concurrent_steps=stages, compute_context=compute_context)
      start = pl.multiple_of(start_ref[w], moe.ROW_ALIGN)
      pipeline(gate_words.at[expert], gate_scale.at[expert], up_words.at[expert], up_scale.at[expert],
               x_ref.at[pl.ds(start, r)])

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((work_expert.shape[0] * r, n_out), jnp.bfloat16),
      grid=(work_expert.shape[0], pl.cdiv(n_out, moe.TILE_N)), grid_names=("w", "n"),
      num_threads=3, thread_name="wg", kernel_name="moe_gate_up_two_wg",
      scratch_types=[plgpu.SMEM((moe.TILE_N, r), jnp.float32),
                     plgpu.SMEM((r, moe.TILE_N), jnp.bfloat16, transforms=moe._bf16_transforms(out_atom)),
                     plgpu.Barrier(num_arrivals=1)],
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(work_expert, block_start, x, gate.words, gate.scale, up.words, up.scale)


def committed(x, work_expert, experts, dequant: str):
  return moe._grouped_kernel(x, work_expert, jnp.zeros_like(work_expert), (experts.gate, experts.up), fuse_silu=True,
                             cfg=moe.TileConfig(BLOCK_K, 2), block_rows=ROWS, int4_dequant=dequant,
                             count_tile_loads=False, interpret=None, grid_order="tile_minor")


def variants(stages=STAGES) -> dict:
  """{name: fn(x, work_expert, experts)}."""
  out = {f"committed, {d}": functools.partial(committed, dequant=d) for d in ("registers", "registers_serial")}
  for s in stages:
    out[f"two warpgroups, {s} stages"] = lambda x, ids, ex, s=s: gate_up_two_warpgroups(
        x, ids, jnp.zeros_like(ids), ex.gate, ex.up, stages=s)
  return out


def markdown(result: dict) -> str:
  names = list(dict.fromkeys(row["variant"] for row in result["rows"]))
  items = sorted({row["items"] for row in result["rows"]})
  us = {(row["variant"], row["items"]): row["gpu_us"] for row in result["rows"]}
  lines = [f"# INT4 gate/up, two compute warpgroups a program ({result['device']}, jax {result['jax']})", "",
           f"GPU us per call (CUPTI), the gate/up kernel alone on n live items of {ROWS} rows (distinct random "
           f"experts of {EXPERTS}). Rows of the two-warpgroup kernel against the committed one: {result['rows_check']}.",
           "", "| variant | " + " | ".join(f"n={n}" for n in items) + " |",
           "| --- | " + " | ".join("---" for _ in items) + " |"]
  for name in names:
    lines.append(f"| {name} | " + " | ".join(f"{us[name, n]:.1f}" if (name, n) in us else "" for n in items) + " |")
  lines += ["", f"Command: `{result['command']}` ({result['seconds']:.0f} s)."]
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  parser.add_argument("--items", type=int, nargs="+", default=list(ITEMS))
  parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES))
  args = parser.parse_args()
  if any(not 2 <= s <= MAX_STAGES for s in args.stages) or any(n < 1 for n in args.items):
    parser.error(f"--stages must be in [2, {MAX_STAGES}] (the ring's shared memory) and --items >= 1")
  if jax.default_backend() != "gpu":
    sys.exit("moe_two_warpgroups.py times Mosaic GPU kernels: run it on the GPU")
  start = time.perf_counter()
  rng = np.random.default_rng(0)
  experts = bench.make_int4(jax.random.key(1), EXPERTS)
  x = jnp.asarray(rng.standard_normal((ROWS, bench.HIDDEN)), jnp.bfloat16)
  fns = {name: jax.jit(fn) for name, fn in variants(args.stages).items()}
  ids = jnp.asarray(rng.choice(EXPERTS, 6, replace=False).astype(np.int32))
  want = np.asarray(fns["committed, registers"](x, ids, experts), np.float32)
  same = [np.array_equal(np.asarray(fn(x, ids, experts), np.float32), want)
          for name, fn in fns.items() if name.startswith("two")]
  rows_check = "bit-identical" if all(same) else "DIFFER"
  print("rows:", rows_check, flush=True)
  rows = []
  for n in args.items:
    calls = [jnp.asarray(rng.choice(EXPERTS, n, replace=n > EXPERTS).astype(np.int32)) for _ in range(bench.ROUTINGS)]
    for name, fn in fns.items():
      us, _ = gpu_timing.per_call_device_us(jax.jit(lambda x, calls, ex, fn=fn: [fn(x, i, ex) for i in calls]),
                                            (x, calls, experts), calls=len(calls))
      rows.append(dict(variant=name, items=n, gpu_us=us))
      print(f"n={n} {name}: {us:.1f} us", flush=True)
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, host=platform.node(),
                command="PYTHONPATH=. python3 " + " ".join(sys.argv), seconds=time.perf_counter() - start,
                rows_check=rows_check, rows=rows)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "moe_two_warpgroups.json").write_text(json.dumps(result, indent=1))
  (args.out / "moe_two_warpgroups.md").write_text(markdown(result))
  if rows_check != "bit-identical":
    sys.exit("the two-warpgroup kernel's rows differ from the committed kernel's")


if __name__ == "__main__":
  main()
