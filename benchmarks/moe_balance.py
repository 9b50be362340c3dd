"""Balanced gate/up programs (the (tile, chunk) units shared evenly) against the default (H200).

    PYTHONPATH=. python3 benchmarks/moe_balance.py --out benchmarks/results   # on the GPU

For ``bench_moe.py``'s routings (T tokens, top-8 over 384 experts; the 48-expert share keeps the
rows of its experts, the rest is padding), INT4, one executable of 16 layer calls per variant,
GPU time from CUPTI, every variant of a cell timed in the same run:

* ``default``: ``moe.moe_experts`` with the share's expected rows, as ``bench_moe.py`` calls it
  (a program per (output tile, item) on the compact grid; the gate/up split at T = 1, 2);
* ``balanced P``: the sorted path with its gate/up kernel on P programs (``balanced_kernel``
  here, not in ``moe``; no split) that share the step's (tile, chunk of K) units evenly, the tiles
  they cut added up by a fold kernel and put in place; the down kernel and the glue as ``moe``'s.

Why it was tried: a program per (output tile, item) quantises the work in whole tiles (at the
48-expert share and T = 9, ~8.6 experts are ~275 gate/up tiles for the 264 programs two an SM
hold at once). Found (``results/moe_balance.md``): correct, bit for bit, and slower in every cell
timed; the gate/up kernel itself gains only 3-5 us, less than the fold and scatter cost.

Rows are checked bit for bit against the default's for the first routing (the chunks' sums are
added in one order either way). Writes NAME.json and NAME.md (``--name``, default
``moe_balance``); ``--merge`` keeps the rows of cells this run does not time.
"""

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

import bench_moe as bench
import results_io
from pallas_kernels import moe

CELLS = ((48, 9), (48, 17), (48, 33), (48, 65), (48, 136), (384, 17))



# The balanced form (an ablation: not in ``moe``). A fixed number of programs share the units
# (tile, chunk of K) in tile order: program p takes units [p U / P', (p + 1) U / P'), U = tiles x
# chunks, P' = min(P, tiles), so each takes at least one tile's worth and a tile is cut between at
# most two programs. A cut tile's first part (the "head", chunks [0, a)) adds its chunk sums as
# the one-program form does and writes that running sum; the second part (the "tail") writes each
# chunk's sums; ``balance_fold_kernel`` adds them on in chunk order, ((S_a + c_a) + ...), applies
# the SiLU, and an XLA scatter puts those tiles in place: the same rows bit for bit as one program
# per tile. (Handing the running sum from program to program instead needs a global semaphore,
# which Mosaic GPU's interpret mode cannot run.)


def balance_ranges(p, num_tiles, chunks: int, programs: int):
  """(u0, u1, live): the units [u0, u1) of program(s) ``p`` among the ``live`` = min(programs,
  max(1, num_tiles)) that run; for traced scalars (in the kernels) and vectors (after them)."""
  live = jnp.clip(jnp.asarray(num_tiles, jnp.int32), 1, programs)
  units = jnp.asarray(num_tiles * chunks, jnp.int32)
  return lax.div(p * units, live), lax.div((p + 1) * units, live), live


def balanced_kernel(x, work_expert, block_start, weights, num_slots, *, programs: int, fuse_silu: bool,
                    cfg: moe.TileConfig, block_rows: int, int4_dequant: str, count_tile_loads: bool, interpret):
  """``moe._grouped_kernel``'s projection (the same arguments; ``cfg.chunk_k`` set, not split) on
  ``programs`` programs sharing the (tile, chunk) units.

  Returns:
    bf16 [W * R, N] in the work layout, every live item's tiles written (the cut ones by the
    fold); plus, when ``count_tile_loads``, int32 [ceil(N / 64), W] as ``_grouped_kernel``'s.
  """
  r, bk = block_rows, cfg.block_k
  if cfg.chunk_k is None or cfg.split_k or programs < 1:
    raise ValueError(f"balanced programs need chunk_k without split_k and programs >= 1, got {cfg}, {programs}")
  w_items = work_expert.shape[0]
  num_w = len(weights)
  is_int4, num_experts, n_out, flat_weights, k_steps, x_atom = moe._weight_dims(weights, bk)
  out_atom = moe._swizzle_elems(n_out, moe.TILE_N)
  n_tiles = pl.cdiv(n_out, moe.TILE_N)
  chunk_steps = cfg.chunk_k // bk
  chunks = pl.cdiv(k_steps, chunk_steps)
  smem_dequant = is_int4 and int4_dequant == "smem"
  # GPU: one pipeline a job, the chunk sums taken at chunk ends inside it (as ``_grouped_kernel``'s
  # fold_in_step); interpret mode cannot store to an accumulator: a pipeline per chunk there.
  in_step = interpret is None
  stages = moe._fit_stages(cfg, num_w, is_int4, smem_dequant, r, num_w * moe.TILE_N * r * 4 + r * moe.TILE_N * 2)
  pipe = dict(is_int4=is_int4, bk=bk, k_steps=k_steps, x_atom=x_atom, stages=stages, int4_dequant=int4_dequant)
  if num_slots is None:
    num_slots = jnp.full((1,), w_items, jnp.int32)

  def body(expert_ref, slots_ref, start_ref, x_ref, *refs):
    w_refs = refs[:len(flat_weights)]
    out_ref, part_ref, *refs = refs[len(flat_weights):]
    if count_tile_loads:
      count_ref, head_count_ref, *refs = refs
    run_smem, (out_smem, *deq_smem) = refs[:num_w], refs[num_w:]
    p = lax.axis_index("p")
    u0, u1, live_programs = balance_ranges(p, jnp.minimum(slots_ref[0], w_items) * n_tiles, chunks, programs)

    def tile(t):
      w, n = lax.div(t, n_tiles), lax.rem(t, n_tiles)
      expert = expert_ref[w]
      return w, n, expert, (expert >= 0) & (expert < num_experts)

    def run_chunks(w, n, expert, c_begin, c_end, consume):
      """Chunks [c_begin, c_end) of tile (w, n), each chunk's sums (the accumulators) handed to
      ``consume(c, accs)``; returns the steps inside K."""
      x_rows = x_ref.at[pl.ds(pl.multiple_of(start_ref[w], moe.ROW_ALIGN), r)]
      expert_w = [ref.at[expert] for ref in w_refs]
      accs_types = [plgpu.ACC((moe.TILE_N, r)) for _ in range(num_w)]
      if in_step:
        first = c_begin * chunk_steps
        num_steps = jnp.minimum(c_end * chunk_steps, k_steps) - first

        def scope(*accs):
          def chunk_end(idx):
            @pl.when((idx % chunk_steps == chunk_steps - 1) | (idx == num_steps - 1))
            def _():
              consume(c_begin + lax.div(idx, chunk_steps), accs)
              for acc in accs:
                acc[...] = jnp.zeros((moe.TILE_N, r), jnp.float32)
          return moe._k_pipeline(accs, expert_w, x_rows, n=n, first=first, num_steps=num_steps, on_step_end=chunk_end,
                             deq_smem=deq_smem, **pipe)
        return pl.run_scoped(scope, *accs_types)

      def chunk(c, steps):
        first = c * chunk_steps

        def scope(*accs):
          chunk_steps_run = moe._k_pipeline(accs, expert_w, x_rows, n=n, first=first,
                                        num_steps=jnp.minimum(chunk_steps, k_steps - first), deq_smem=deq_smem, **pipe)
          consume(c, accs)
          return chunk_steps_run
        return steps + pl.run_scoped(scope, *accs_types)
      return lax.fori_loop(c_begin, c_end, chunk, jnp.int32(0))

    def add_to_run(c, accs):
      del c
      for acc, run in zip(accs, run_smem):
        run[...] = run[...] + acc[...]

    def store_chunk(boundary):
      def consume(c, accs):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's copies have read the tiles
        for acc, run in zip(accs, run_smem):
          run[...] = acc[...]
        plgpu.commit_smem()
        for i, run in enumerate(run_smem):
          plgpu.copy_smem_to_gmem(run, part_ref.at[boundary, c, i])
      return consume

    def running_sum(w, n, expert, c_end):
      for run in run_smem:
        run[...] = jnp.zeros((moe.TILE_N, r), jnp.float32)
      return run_chunks(w, n, expert, 0, c_end, add_to_run)

    def count(n, w, steps):
      if count_tile_loads:
        count_ref[n, w] = steps

    def head_count(steps):
      if count_tile_loads:
        head_count_ref[p] = steps

    @pl.when(p < live_programs)
    def _():
      a0, t0 = lax.rem(u0, chunks), lax.div(u0, chunks)
      a1, t1 = lax.rem(u1, chunks), lax.div(u1, chunks)

      @pl.when(a0 != 0)  # the tail of tile t0, whose head program p - 1 ran
      def _():
        w, n, expert, live = tile(t0)
        pl.when(~live)(lambda: count(n, w, jnp.int32(0)))

        @pl.when(live)
        def _():
          steps = run_chunks(w, n, expert, a0, chunks, store_chunk(p - 1))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # before the tiles are reused
          count(n, w, steps)

      def whole(t, carry):
        w, n, expert, live = tile(t)
        pl.when(~live)(lambda: count(n, w, jnp.int32(0)))

        @pl.when(live)
        def _():
          steps = running_sum(w, n, expert, chunks)
          sums = [run[...] for run in run_smem]
          result = moe._silu_mul(*sums) if fuse_silu else sums[0]
          out_smem.T[...] = result.astype(jnp.bfloat16)  # [moe.TILE_N, R] into [R, moe.TILE_N]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(w * r, r), pl.ds(n * moe.TILE_N, moe.TILE_N)])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          count(n, w, steps)
        return carry

      lax.fori_loop(t0 + (a0 != 0).astype(jnp.int32), t1, whole, jnp.int32(0))

      @pl.when(a1 != 0)  # the head of tile t1: its running sum after a1 chunks, for the fold
      def _():
        w, n, expert, live = tile(t1)
        pl.when(~live)(lambda: head_count(jnp.int32(0)))

        @pl.when(live)
        def _():
          steps = running_sum(w, n, expert, a1)
          plgpu.commit_smem()
          for i, run in enumerate(run_smem):
            plgpu.copy_smem_to_gmem(run, part_ref.at[p, a1 - 1, i])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          head_count(steps)

      pl.when(a1 == 0)(lambda: head_count(jnp.int32(0)))

    pl.when(p >= live_programs)(lambda: head_count(jnp.int32(0)))

  out_types = [jax.ShapeDtypeStruct((w_items * r, n_out), jnp.bfloat16),
               jax.ShapeDtypeStruct((programs, chunks, num_w, moe.TILE_N, r), jnp.float32)]
  if count_tile_loads:
    out_types += [jax.ShapeDtypeStruct((n_tiles, w_items), jnp.int32), jax.ShapeDtypeStruct((programs,), jnp.int32)]
  scratch = [plgpu.SMEM((moe.TILE_N, r), jnp.float32) for _ in range(num_w)]
  scratch.append(plgpu.SMEM((r, moe.TILE_N), jnp.bfloat16, transforms=moe._bf16_transforms(out_atom)))
  if smem_dequant:
    scratch += [plgpu.SMEM((moe.TILE_N, bk), jnp.bfloat16, transforms=moe._bf16_transforms(x_atom)) for _ in range(num_w)]
  kernel = plgpu.kernel(
      body, out_type=tuple(out_types), grid=(programs,), grid_names=("p",),
      kernel_name="moe_gate_up" if fuse_silu else "moe_down", scratch_types=scratch, interpret=interpret,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  out, partials, *counts = kernel(work_expert, num_slots, block_start, x, *flat_weights)

  # The cut tiles: their parts' sums added in chunk order (and the SiLU), then put in place.
  num_tiles = jnp.minimum(num_slots[0], w_items) * n_tiles
  live_expert = (work_expert >= 0) & (work_expert < num_experts)
  boundary = jnp.arange(programs - 1, dtype=jnp.int32)
  _, cut, live_programs = balance_ranges(boundary, num_tiles, chunks, programs)
  cut_tile = cut // chunks
  cut_w, cut_n = cut_tile // n_tiles, cut_tile % n_tiles
  is_cut = (boundary + 1 < live_programs) & (cut % chunks != 0) & live_expert[jnp.minimum(cut_w, w_items - 1)]
  if programs > 1:
    folded = balance_fold_kernel(partials, work_expert, num_slots, n_tiles=n_tiles, num_experts=num_experts,
                                  fuse_silu=fuse_silu, interpret=interpret)  # [P - 1, R, moe.TILE_N]
    rows = jnp.where(is_cut, cut_w, w_items)[:, None, None] * r + jnp.arange(r)[None, :, None]
    cols = cut_n[:, None, None] * moe.TILE_N + jnp.arange(moe.TILE_N)[None, None, :]
    out = out.at[rows, cols].set(folded, mode="drop")  # the dead boundaries' rows are past the end
  if not count_tile_loads:
    return out
  finished, heads = counts
  loads = jnp.where(jnp.arange(w_items)[None, :] < jnp.minimum(num_slots[0], w_items), finished, 0)
  loads = loads.at[cut_n, jnp.where(is_cut, cut_w, w_items)].add(heads[:-1], mode="drop")
  return out, loads


def balance_fold_kernel(partials, work_expert, num_slots, *, n_tiles: int, num_experts: int, fuse_silu: bool,
                         interpret):
  """The tiles ``balanced_kernel``'s programs cut: at boundary s (between programs s and s + 1,
  at unit b = u1(s), a = b mod chunks > 0), program s wrote its running sum S_a at chunk a - 1 and
  program s + 1 each later chunk's sums; adds them in chunk order, ((S_a + c_a) + c_{a+1}) + ...,
  as one program adds its chunks, then SiLU(gate) * up (or the one weight's sum): f32 [P, C,
  num_w, moe.TILE_N, R] -> bf16 [P - 1, R, moe.TILE_N]; the blocks of boundaries that cut no live tile are
  unwritten."""
  programs, chunks, num_w, _, r = partials.shape
  w_items = work_expert.shape[0]
  out_atom = moe._swizzle_elems(moe.TILE_N)

  def body(expert_ref, slots_ref, part_ref, out_ref, part_smem, out_smem, barriers):
    s = lax.axis_index("s")
    _, cut, live_programs = balance_ranges(s, jnp.minimum(slots_ref[0], w_items) * n_tiles, chunks, programs)
    a = lax.rem(cut, chunks)
    w = jnp.minimum(lax.div(lax.div(cut, chunks), n_tiles), w_items - 1)
    expert = expert_ref[w]

    @pl.when((s + 1 < live_programs) & (a != 0) & (expert >= 0) & (expert < num_experts))
    def _():
      for c in range(chunks):
        pl.when(c >= a - 1)(lambda c=c: plgpu.copy_gmem_to_smem(part_ref.at[s, c], part_smem.at[c], barriers.at[c]))
      for c in range(chunks):
        pl.when(c >= a - 1)(lambda c=c: plgpu.barrier_wait(barriers.at[c]))
      sums = []
      for i in range(num_w):
        def add(c, total, i=i):
          return total + plgpu.layout_cast(part_smem[c, i], plgpu.Layout.WGMMA)
        sums.append(lax.fori_loop(a - 1, chunks, add, jnp.zeros((moe.TILE_N, r), jnp.float32)))
      result = moe._silu_mul(*sums) if fuse_silu else sums[0]
      out_smem.T[...] = result.astype(jnp.bfloat16)  # [moe.TILE_N, R] into [R, moe.TILE_N], as the main kernel
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_ref.at[s])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((programs - 1, r, moe.TILE_N), jnp.bfloat16),
      grid=(programs - 1,), grid_names=("s",), kernel_name="moe_fold",
      scratch_types=[plgpu.SMEM((chunks, num_w, moe.TILE_N, r), jnp.float32),
                     plgpu.SMEM((r, moe.TILE_N), jnp.bfloat16, transforms=moe._bf16_transforms(out_atom)),
                     plgpu.Barrier(num_arrivals=1, num_barriers=chunks)],
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(work_expert, num_slots, partials)


def balanced_experts(x_sorted, group_sizes, experts, *, programs: int, expected_rows: int | None = None,
                     int4_dequant: str | None = None, tiles: moe.KernelTiles | None = None, interpret=None,
                     count_tile_loads: bool = False):
  """``moe.moe_experts``' sorted path (always: no per-pair items) with the gate/up kernel on
  ``programs`` balanced programs (``tiles``' gate/up, default ``moe.default_tiles``', chunked, not
  split); with ``count_tile_loads``, (y, gate_up_steps, down_steps) as
  ``moe.moe_experts_with_tile_loads``."""
  a, _, inter, e = moe._check_inputs(x_sorted, group_sizes, experts)
  rows = a if expected_rows is None else expected_rows
  r, dequant = moe._resolve_options(a, e, inter, None, int4_dequant, rows, interpret,
                                   is_int4=isinstance(experts, moe.Int4Experts))
  if tiles is None:  # the default tiles' gate/up, chunked, without the split
    tiles = moe.default_tiles(experts, rows, r)
    tiles = dataclasses.replace(tiles, gate_up=dataclasses.replace(
        tiles.gate_up, split_k=False, chunk_k=tiles.gate_up.chunk_k or moe.CHUNK_K))
  gate_up = tiles.gate_up
  work = moe.work_list(group_sizes, a, r)
  if moe.padded_rows(a, r) > a:
    x_sorted = jnp.pad(x_sorted, ((0, moe.padded_rows(a, r) - a), (0, 0)))
  w_items = work.expert.shape[0]
  h = balanced_kernel(x_sorted, work.expert, work.block_start, (experts.gate, experts.up), work.num_slots,
                      programs=programs, fuse_silu=True, cfg=gate_up, block_rows=r, int4_dequant=dequant,
                      count_tile_loads=count_tile_loads, interpret=interpret)
  h, h_loads = h if count_tile_loads else (h, None)
  out = moe._grouped_kernel(h, work.expert, None, (experts.down,), fuse_silu=False, cfg=tiles.down, block_rows=r,
                            int4_dequant=dequant, count_tile_loads=count_tile_loads, interpret=interpret,
                            grid_order=tiles.grid_order, num_slots=work.num_slots,
                            item_programs=moe.default_item_programs(e, rows, w_items))
  out, out_loads = out if count_tile_loads else (out, None)
  y = moe._work_rows(out, jnp.clip(work.row_column, 0, w_items * r - 1), x_sorted.shape[1])
  y = jnp.where(work.routed[:, None], y, jnp.zeros((), y.dtype)).astype(jnp.bfloat16)
  return (y, h_loads, out_loads) if count_tile_loads else y


def layer(programs: int | None, dequant: str | None):
  def call(x, g, w):
    rows = bench.expected_rows(x, g)
    if programs is None:
      return moe.moe_experts(x, g, w, expected_rows=rows, int4_dequant=dequant)
    return balanced_experts(x, g, w, programs=programs, expected_rows=rows, int4_dequant=dequant)
  return call


def cell(row: dict) -> tuple:
  """A row's cell, (experts, tokens): ``--merge`` keeps an earlier run's rows of the cells this
  run did not time."""
  return (row["experts"], row["tokens"])


def markdown(result: dict) -> str:
  lines = [f"# Balanced INT4 gate/up programs against the default ({result['device']}, jax {result['jax']})",
           "", "GPU us per layer call (CUPTI; 16 routings in one executable), the kernels' shares after it "
           "(the fold kernel of the balanced form is `moe_fold`); `rows`: against the default's rows for the "
           "first routing.", "",
           "| experts | T | touched | variant | int4 form | GPU us | vs default | kernels | rows |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in result["rows"]:
    kinds = results_io.kernel_shares(row["kernels"])
    lines.append(f"| {row['experts']} | {row['tokens']} | {row['touched']:.1f} | {row['variant']} | {row['dequant']} | "
                 f"{row['gpu_us']:.1f} | {row['vs_default']:.2f}x | {kinds} | {row['rows']} |")
  return results_io.with_command(lines, result)


def parse_args(argv=None):
  parser = results_io.results_parser(__doc__, "moe_balance", merge=True)
  parser.add_argument("--cells", nargs="+", default=[f"{e}:{t}" for e, t in CELLS],
                      help="experts:tokens pairs, e.g. 48:9 384:17")
  parser.add_argument("--programs", nargs="+", type=int, default=[264],
                      help="balance_programs values to time (e.g. 132 264 396)")
  parser.add_argument("--dequant", nargs="+", default=["auto"], choices=["auto", "registers", "registers_serial"],
                      help="INT4 forms for the balanced variants (auto: the default's choice)")
  args = parser.parse_args(argv)
  for cell in args.cells:
    parts = cell.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) > bench.ALL_EXPERTS:
      parser.error(f"--cells {cell!r}: expected EXPERTS:TOKENS, positive ints, experts <= {bench.ALL_EXPERTS}")
  if any(p < 1 for p in args.programs):
    parser.error(f"--programs {args.programs}: each must be a positive int")
  return args


def main(argv=None):
  args = parse_args(argv)
  results_io.require_gpu("moe_balance.py")
  start = time.perf_counter()
  rows, weights = [], {}
  for cell in args.cells:
    e, t = map(int, cell.split(":"))
    if e not in weights:
      weights.clear()  # one expert count's weights on the device at a time
      weights[e] = bench.make_int4(jax.random.key(e + 1), e)
    w = weights[e]
    routings = bench.routings(t, e, seed=100 + t)
    calls = [(r[0], r[1]) for r in routings]
    touched = float(np.mean([r[2] for r in routings]))
    variants = [("default", None, None)]
    for programs in args.programs:
      for dequant in args.dequant:
        variants.append((f"balanced {programs}", programs, None if dequant == "auto" else dequant))
    base = None
    for name, programs, dequant in variants:
      fn = layer(programs, dequant)
      us, kinds = bench.device_in_step(bench.in_step(fn), calls, w)
      y = np.asarray(jax.jit(fn)(*calls[0], w).astype(jnp.float32))
      if base is None:
        base, check = (y, us), "-"
      else:
        check = "bit-identical" if np.array_equal(y, base[0]) else "DIFFER"
      rows_expected = bench.expected_rows(*calls[0])
      form = dequant or moe.default_int4_dequant(e, rows_expected, bench.INTER)
      rows.append(dict(experts=e, tokens=t, touched=touched, variant=name, dequant=form, gpu_us=us,
                       vs_default=us / base[1], rows=check,
                       kernels={k: v for k, v in kinds.items() if "mosaic_gpu" in k}))
      print(f"E={e} T={t} {name} {form}: {us:.1f} us ({rows[-1]['vs_default']:.2f}x) {check}", flush=True)
  command = "PYTHONPATH=. python3 " + " ".join(sys.argv if argv is None else ["benchmarks/moe_balance.py", *argv])
  results_io.save_rows(rows, out=args.out, name=args.name, command=command, start=start, markdown=markdown,
                       merge=args.merge, cell=cell)


if __name__ == "__main__":
  main()
