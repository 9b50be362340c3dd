"""What limits the MoE kernels where few experts are touched (the 48-expert share, H200).

    PYTHONPATH=. python3 benchmarks/moe_waves.py --out benchmarks/results   # on the GPU

Two measurements, GPU time from CUPTI (16 calls in one executable, as ``bench_moe.py``):

1. **Items sweep**: the gate/up and the down kernel alone (``moe._grouped_kernel``) on ``n`` live
   work items of one row each, every call on ``n`` distinct random experts of 48 (so no call finds
   its weights in L2), for the kernels' default tiles and the alternatives that change how many
   programs share an SM or how deep each one's pipeline is: INT4 ``registers`` (the default below
   4 programs per SM: 194 registers a thread, 2 programs an SM), ``registers_serial`` (114, 4 an
   SM), and pipeline depths. One item is 32 gate/up programs (2048 / 64 output features) and 112
   down programs (7168 / 64); the H200 has 132 SMs. The weight rate column is the gate/up
   kernel's touched weight bytes over its time.
2. **Dead programs and glue**: ``moe.moe_experts`` at the 48-expert share for ``bench_moe.py``'s
   routings (T tokens, top-8 over 384 experts, rows of the other 336 experts as padding): as is;
   with every row routed elsewhere (all items dead: the cost of programs that exit at once and
   of the plain-jnp work list and output take); and the two kernels alone on a compacted list
   (live items only, padded to the most any of the 16 routings has), i.e. without dead programs
   and glue.

Writes ``moe_waves.json`` and ``moe_waves.md``.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import bench_moe as bench
import gpu_timing
from pallas_kernels import moe

EXPERTS = 48
ROWS = 16  # rows per work item (the share's default at T = 1..136)
ITEMS = (1, 2, 4, 6, 8, 9, 12, 16, 24, 32, 64)
# (format, label, INT4 form, gate/up tiles, down tiles)
SWEEP = (
    ("int4", "registers (default), 2 stages", "registers", moe.INT4_TILES.gate_up, moe.INT4_TILES.down),
    ("int4", "registers_serial, 2 stages", "registers_serial", moe.INT4_TILES.gate_up, moe.INT4_TILES.down),
    ("int4", "registers, 4 stages", "registers", moe.TileConfig(256, 4), moe.TileConfig(256, 4)),
    ("bf16", "default (4 stages)", None, moe.BF16_TILES.gate_up, moe.BF16_TILES.down),
    ("bf16", "8 / 6 stages", None, moe.TileConfig(64, 8), moe.TileConfig(128, 6)),
)


def items_sweep(weights, rng):
  x = jnp.asarray(rng.standard_normal((ROWS, bench.HIDDEN)), jnp.bfloat16)
  rows = []
  for fmt, label, dequant, gate_up_cfg, down_cfg in SWEEP:
    w = weights[fmt]
    common = dict(block_rows=ROWS, int4_dequant=dequant or "registers", count_tile_loads=False, interpret=None,
                  grid_order="tile_minor")
    gate_up = jax.jit(lambda x, ids, w: moe._grouped_kernel(
        x, ids, jnp.zeros_like(ids), (w.gate, w.up), fuse_silu=True, cfg=gate_up_cfg, **common))
    down = jax.jit(lambda h, ids, w: moe._grouped_kernel(h, ids, None, (w.down,), fuse_silu=False, cfg=down_cfg,
                                                         **common))
    for n in ITEMS:
      ids = [jnp.asarray(rng.choice(EXPERTS, n, replace=n > EXPERTS).astype(np.int32)) for _ in range(bench.ROUTINGS)]
      h = jnp.asarray(rng.standard_normal((n * ROWS, bench.INTER)), jnp.bfloat16)
      t_gate_up, _ = gpu_timing.per_call_device_us(jax.jit(lambda x, ids, w: [gate_up(x, i, w) for i in ids]),
                                                   (x, ids, w), calls=len(ids))
      t_down, _ = gpu_timing.per_call_device_us(jax.jit(lambda h, ids, w: [down(h, i, w) for i in ids]),
                                                (h, ids, w), calls=len(ids))
      weight_bytes = bench.weight_bytes(fmt, n) * 2 / 3  # gate and up of n experts
      rows.append(dict(format=fmt, variant=label, items=n, gate_up_us=t_gate_up, down_us=t_down,
                       gate_up_weight_tb_s=weight_bytes / t_gate_up / 1e6))
      print(rows[-1], flush=True)
  return rows


def dead_programs(weights, tokens):
  rows = []
  for t in tokens:
    sets = bench.routings(t, EXPERTS, seed=EXPERTS * 100 + t)
    a = sets[0][0].shape[0]
    expected = bench.expected_rows(sets[0][0], sets[0][1])
    r = moe.default_block_rows(EXPERTS, expected, is_int4=True)  # one list for both formats: INT4's cap fits both
    dead = [(x, jnp.zeros_like(g), 0, ids) for x, g, _, ids in sets]
    lists = [moe.work_list(g, a, r) for _, g, _, _ in sets]
    live = [np.asarray(wl.expert) >= 0 for wl in lists]
    width = max(1, max(int(m.sum()) for m in live))
    compact = []
    for (x, g, touched, ids), wl, m in zip(sets, lists, live):
      expert = np.full(width, -1, np.int32)
      start = np.zeros(width, np.int32)
      expert[:m.sum()] = np.asarray(wl.expert)[m]
      start[:m.sum()] = np.asarray(wl.block_start)[m]
      x = jnp.pad(x, ((0, moe.padded_rows(a, r) - a), (0, 0)))
      compact.append((x, (jnp.asarray(expert), jnp.asarray(start)), touched, ids))
    for fmt, w in weights.items():
      dequant = moe.default_int4_dequant(EXPERTS, expected, bench.INTER) if fmt == "int4" else "registers"
      call = lambda x, g, w: moe.moe_experts(x, g, w, expected_rows=expected)
      kernels = lambda x, g, w, dq=dequant: moe._expert_projections(x, g[0], g[1], w, r, dq, None, None)
      for label, fn, inputs, slots in (("call as is", call, sets, moe.max_work_items(EXPERTS, a, r)),
                                       ("every row routed elsewhere", call, dead, moe.max_work_items(EXPERTS, a, r)),
                                       ("kernels on the live items only", kernels, compact, width)):
        us, kinds = bench.device_in_step(bench.in_step(fn), inputs, w)
        rows.append(dict(format=fmt, tokens=t, variant=label, item_slots=slots,
                         mean_live_items=float(np.mean([m.sum() for m in live])), time_us=us,
                         gate_up_us=sum(v for k, v in kinds.items() if k.startswith("moe_gate_up")),
                         down_us=sum(v for k, v in kinds.items() if k.startswith("moe_down")),
                         glue_us=sum(v for k, v in kinds.items() if not k.startswith("moe_"))))
        print(rows[-1], flush=True)
  return rows


def markdown(result) -> str:
  lines = [f"# MoE kernels where few experts are touched ({result['device']}, jax {result['jax']})", "",
           "GPU time per call (CUPTI, 16 calls in one executable), us. "
           f"Command: `{result['command']}` ({result['seconds']:.0f} s).", "",
           "## Items sweep: the kernels alone on n live items of one row (48 experts)", "",
           "One item: 32 gate/up programs, 112 down programs; 132 SMs. *TB/s*: the gate/up kernel's "
           "weight bytes over its time.", ""]
  ns = sorted({r["items"] for r in result["sweep"]})
  lines += ["| format | variant | kernel | " + " | ".join(f"n={n}" for n in ns) + " |",
            "| --- | --- | --- | " + " | ".join("---" for _ in ns) + " |"]
  variants = list(dict.fromkeys((r["format"], r["variant"]) for r in result["sweep"]))
  for fmt, label in variants:
    cells = {r["items"]: r for r in result["sweep"] if (r["format"], r["variant"]) == (fmt, label)}
    lines.append(f"| {fmt} | {label} | gate/up | " + " | ".join(
        f"{cells[n]['gate_up_us']:.1f} ({cells[n]['gate_up_weight_tb_s']:.2f} TB/s)" for n in ns) + " |")
    lines.append(f"| {fmt} | {label} | down | " + " | ".join(f"{cells[n]['down_us']:.1f}" for n in ns) + " |")
  lines += ["", "## Dead programs and glue: `moe_experts` at the 48-expert share", "",
            "| format | T | variant | item slots | live items (mean) | GPU us | gate/up | down | glue (plain-jnp kernels) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["dead"]:
    lines.append(f"| {r['format']} | {r['tokens']} | {r['variant']} | {r['item_slots']} | {r['mean_live_items']:.1f} | "
                 f"{r['time_us']:.1f} | {r['gate_up_us']:.1f} | {r['down_us']:.1f} | {r['glue_us']:.1f} |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  parser.add_argument("--tokens", type=int, nargs="+", default=[1, 9, 17])
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    sys.exit("moe_waves.py times the Mosaic GPU kernels: run it on the GPU")
  start = time.perf_counter()
  weights = {"int4": bench.make_int4(jax.random.key(EXPERTS + 1), EXPERTS),
             "bf16": bench.make_bf16(jax.random.key(EXPERTS), EXPERTS)}
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, python=platform.python_version(),
                command="PYTHONPATH=. python3 benchmarks/moe_waves.py " + " ".join(sys.argv[1:]),
                sweep=items_sweep(weights, np.random.default_rng(0)), dead=dead_programs(weights, args.tokens))
  result["seconds"] = time.perf_counter() - start
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "moe_waves.json").write_text(json.dumps(result, indent=1))
  (args.out / "moe_waves.md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  main()
