"""Tiling sweep for the MoE kernel on the H200: which ``KernelTiles`` and split-K setting is fastest.

    PYTHONPATH=. python3 benchmarks/tune_moe.py --out benchmarks/results   # on the GPU

Times every variant side by side in one process, on the same weights, routings and timing as
``bench_moe.py`` (one K2.6 layer, random top-8; 16 calls per executable), with the fraction of
the touched experts' read roofline. Each variant's output is checked against the default variant's (relative L2), and the
default against the float32 reference at the 48-expert share. ``prep`` times the plain-jnp work
around the kernels alone (the work list and the take back to sorted rows): a floor under every variant.
Writes ``tune_moe.json`` and ``tune_moe.md``; the defaults in ``pallas_kernels/moe.py`` are
chosen from it.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402  (the same weights, routings, timer and ceilings)
from pallas_kernels import moe  # noqa: E402

T_ = moe.TileConfig


def tiles(gate_up, down):
  return moe.KernelTiles(gate_up=T_(*gate_up), down=T_(*down))


# name -> (format, keyword arguments of moe.moe_experts)
VARIANTS = {
    "bf16": ("bf16", {}),
    "bf16 gu128x4 d256x3": ("bf16", {"tiles": tiles((128, 4), (256, 3))}),
    "bf16 gu64x6 d128x6": ("bf16", {"tiles": tiles((64, 6), (128, 6))}),
    "int4": ("int4", {}),
    "int4 registers": ("int4", {"int4_dequant": "registers"}),
    "int4 serial": ("int4", {"int4_dequant": "registers_serial"}),
    "int4 256x3": ("int4", {"tiles": tiles((256, 3), (256, 3))}),
    "int4 512x2": ("int4", {"tiles": tiles((512, 2), (512, 2))}),
    "int4 serial 256x3": ("int4", {"int4_dequant": "registers_serial", "tiles": tiles((256, 3), (256, 3))}),
    "int4 serial 256x4": ("int4", {"int4_dequant": "registers_serial", "tiles": tiles((256, 4), (256, 4))}),
}


def prep_only(x_sorted, group_sizes, w):
  """The plain-jnp part of ``moe_experts`` with the kernels left out: the work list, and a take of
  A rows as the one back from the work layout does (here from x_sorted itself)."""
  a = x_sorted.shape[0]
  work = moe.work_list(group_sizes, a, bench_moe.default_block_rows(x_sorted, group_sizes, w))
  y = jnp.take(x_sorted, jnp.clip(work.row_column, 0, a - 1), axis=0)
  return jnp.where(work.routed[:, None], y, 0)


def reference(x, g, experts):
  if isinstance(experts, moe.Int4Experts):
    experts = moe.dequantize_experts(experts)
  return moe.reference_experts(x, g, experts)


def rel_l2(a, b, rows):
  a = np.asarray(a.astype(jnp.float32))[:rows]
  b = np.asarray(b.astype(jnp.float32))[:rows]
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(args):
  t_start = time.perf_counter()
  weights = {}
  for e in args.experts:
    weights[("bf16", e)] = bench_moe.make_bf16(jax.random.key(e), e)
    weights[("int4", e)] = bench_moe.make_int4(jax.random.key(e + 1), e)
  data = {(e, t): bench_moe.routings(t, e, seed=1000 * e + t) for e in args.experts for t in args.tokens}
  names = [n for n in VARIANTS if not args.variants or n in args.variants] + ["prep"]
  cells = [(e, t, n) for e in args.experts for t in args.tokens for n in names
           if not (e == args.experts[0] and t not in args.tokens_all_experts)]

  def fn_of(name):
    if name == "prep":
      return prep_only
    kwargs = VARIANTS[name][1]
    return lambda x, g, w: moe.moe_experts(x, g, w, **{"expected_rows": bench_moe.expected_rows(x, g), **kwargs})

  def lower(cell):
    e, t, name = cell
    fmt = VARIANTS[name][0] if name != "prep" else "bf16"
    sets = data[(e, t)]
    return bench_moe.in_step(fn_of(name)).lower([s[0] for s in sets], [s[1] for s in sets], weights[(fmt, e)])

  compiled = bench_moe.compile_cells(cells, lower, args.compile_threads)
  print(f"compiled in {time.perf_counter() - t_start:.0f} s", flush=True)
  caps = bench_moe.ceilings()
  stream = caps["stream_read_bytes_per_s"]
  print(f"stream {stream / 1e12:.2f} TB/s", flush=True)

  # Reference check of the defaults at the smallest expert count (dequantising 384 INT4 experts
  # would take 34 GB).
  checks = {}
  e_small = min(args.experts)
  for fmt in ("bf16", "int4"):
    t = args.tokens[min(1, len(args.tokens) - 1)]
    cell = (e_small, t, fmt)
    fn = compiled.get(cell)
    if fn is None or isinstance(fn, Exception):
      continue
    sets = data[(e_small, t)]
    x, g, _ = sets[0]
    want = jax.jit(reference)(x, g, weights[(fmt, e_small)])
    got = fn([s[0] for s in sets], [s[1] for s in sets], weights[(fmt, e_small)])[0]
    checks[f"{fmt} E={e_small} T={t} vs f32 reference"] = rel_l2(got, want, int(np.asarray(g).sum()))

  rows = []
  baseline_out = {}
  for cell in cells:
    e, t, name = cell
    fmt = VARIANTS[name][0] if name != "prep" else "bf16"
    sets = data[(e, t)]
    touched = statistics.mean(s[2] for s in sets)
    row = {"experts": e, "tokens": t, "variant": name, "format": fmt, "distinct_experts": touched,
           "roofline_us": bench_moe.weight_bytes(fmt, touched) / stream * 1e6}
    fn = compiled[cell]
    if isinstance(fn, Exception):
      row["error"] = f"{type(fn).__name__}: {str(fn)[:400]}"
    elif time.perf_counter() - t_start > args.budget_s:
      row["error"] = "skipped: deadline"
    else:
      try:
        w = weights[(fmt, e)]
        g = sets[0][1]
        out = fn([s[0] for s in sets], [s[1] for s in sets], w)[0]
        if name != "prep":
          key = (e, t, fmt)
          if name == fmt and key not in baseline_out:
            baseline_out[key] = out
          elif key in baseline_out:
            row["rel_l2_vs_default"] = rel_l2(out, baseline_out[key], int(np.asarray(g).sum()))
        row["time_us"] = bench_moe.timed_in_step(fn, sets, w) * 1e6
        row["roofline_fraction"] = row["roofline_us"] / row["time_us"]
      except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
    print(json.dumps(row), flush=True)
    rows.append(row)
  dev = jax.devices()[0]
  return {"device_kind": dev.device_kind, "jax": jax.__version__, "python": platform.python_version(),
          "argv": sys.argv[1:], "ceilings": caps, "checks": checks, "rows": rows,
          "wall_s": time.perf_counter() - t_start}


def markdown(result) -> str:
  caps = result["ceilings"]
  lines = ["# MoE kernel tiling sweep (one K2.6 layer, random top-8)", "",
           f"{result['device_kind']}, jax {result['jax']}; read-only stream "
           f"{caps['stream_read_bytes_per_s'] / 1e12:.2f} TB/s measured in the same run. Each cell: median us "
           "per call (fraction of the touched experts' read roofline). Tiles: block_k x stages for gate/up "
           "(gu) and down (d), or both.", ""]
  by = {(r["experts"], r["tokens"], r["variant"]): r for r in result["rows"]}
  cols = sorted({(r["experts"], r["tokens"]) for r in result["rows"]}, key=lambda c: (-c[0], c[1]))
  variants = list(dict.fromkeys(r["variant"] for r in result["rows"]))
  lines.append("| variant | " + " | ".join(f"E={e} T={t}" for e, t in cols) + " |")
  lines.append("| --- |" + " --- |" * len(cols))
  for v in variants:
    cells = []
    for c in cols:
      r = by.get((*c, v))
      if r is None:
        cells.append("-")
      elif "time_us" in r:
        frac = f" ({r['roofline_fraction']:.0%})" if v != "prep" else ""
        cells.append(f"{r['time_us']:.0f}{frac}")
      else:
        cells.append("error" if "skipped" not in r.get("error", "") else "skipped")
    lines.append(f"| {v} | " + " | ".join(cells) + " |")
  lines.append("")
  worst = max((r.get("rel_l2_vs_default", 0.0) for r in result["rows"]), default=0.0)
  lines.append(f"Largest relative L2 of a variant against the default: {worst:.1e}.")
  for k, v in result["checks"].items():
    lines.append(f"Check: {k}: relative L2 {v:.1e}.")
  errors = [r for r in result["rows"] if "error" in r]
  for r in errors:
    lines.append(f"- E={r['experts']} T={r['tokens']} {r['variant']}: {r['error']}")
  lines.append(f"\nCommand: `PYTHONPATH=. python3 benchmarks/tune_moe.py {' '.join(result['argv'])}`")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  parser.add_argument("--experts", type=int, nargs="+", default=[bench_moe.ALL_EXPERTS, 48])
  parser.add_argument("--tokens", type=int, nargs="+", default=[1, 17, 136])
  parser.add_argument("--tokens-all-experts", type=int, nargs="+", default=[1, 17, 136],
                      help="T at which to run the first (largest) expert count")
  parser.add_argument("--variants", nargs="*", default=[], help="names from VARIANTS (default all)")
  parser.add_argument("--compile-threads", type=int, default=12)
  parser.add_argument("--budget-s", type=float, default=400.0, help="skip timing cells past this")
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("tune_moe.py needs a CUDA GPU")
  result = run(args)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "tune_moe.json").write_text(json.dumps(result, indent=1))
  (args.out / "tune_moe.md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  main()
