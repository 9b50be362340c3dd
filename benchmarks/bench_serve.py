"""Load generator for the server: throughput and latency at several concurrencies, --spec none vs ddtree.

    PYTHONPATH=. python3 benchmarks/bench_serve.py --out benchmarks/results        # on the H200

For each spec the server is started as operators start it, ``python -m ddtree_jax.serve`` in its own
process (so the load generator's Python work does not share the server's interpreter lock), and
is ready once its warm-up has compiled every step; then, at each concurrency, that many
clients stream completions of held-out prompts (greedy, fixed ``max_tokens``, EOS ignored so both
specs generate the same number of tokens) over loopback HTTP. Reported per cell: output tokens/s,
time to first token (TTFT) and inter-token latency (ITL: (last - first token time) / (tokens - 1)
per request) percentiles, and the mean accepted length read from the server's /metrics.
``--attention-impl pallas --moe-impl pallas`` serves with the Mosaic GPU kernels (the server's
flags of the same names). Results: NAME.json, NAME.md and NAME.png in --out (``--name``, default
bench_serve).
"""

import argparse
import asyncio
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from models import loading
from serve.config import KERNEL_IMPLS
from serve.launch import server_process

READY_TIMEOUT_S = 900


def held_out_prompts(count: int, max_prompt: int) -> list[list[int]]:
  path = loading.resolve_model_dir("kimi-demo") / "held_out_prompts.json"
  prompts = [p["tokens"][:max_prompt] for p in json.loads(path.read_text())["prompts"]]
  return [prompts[i % len(prompts)] for i in range(count)]


async def one_request(http: httpx.AsyncClient, url: str, prompt, max_tokens: int) -> dict:
  body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
          "stream_options": {"include_usage": True}}
  start = time.perf_counter()
  token_times, tokens = [], 0
  async with http.stream("POST", url + "/v1/completions", json=body) as r:
    if r.status_code != 200:
      raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if "error" in chunk:
        raise RuntimeError(chunk["error"]["message"])
      if chunk["choices"] and chunk["choices"][0]["text"]:
        token_times.append(time.perf_counter())
      if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
  end = time.perf_counter()
  first = token_times[0] if token_times else end
  itl = (token_times[-1] - first) / (tokens - 1) if tokens > 1 and len(token_times) > 1 else float("nan")
  return {"ttft": first - start, "itl": itl, "latency": end - start, "tokens": tokens}


async def run_level(url: str, prompts, concurrency: int, max_tokens: int) -> dict:
  queue: asyncio.Queue = asyncio.Queue()
  for p in prompts:
    queue.put_nowait(p)
  results = []
  limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
  async with httpx.AsyncClient(timeout=600, limits=limits) as http:

    async def worker():
      while not queue.empty():
        prompt = queue.get_nowait()
        results.append(await one_request(http, url, prompt, max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
  pct = lambda key, q: float(np.nanpercentile([r[key] for r in results], q))
  tokens = sum(r["tokens"] for r in results)
  return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
          "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
          **{f"{key}_p{q}_ms": 1e3 * pct(key, q) for key in ("ttft", "itl", "latency") for q in (50, 90, 99)}}


def device_name() -> str:
  """The GPU's name as nvidia-smi gives it (jax's device_kind alike), without starting a jax backend
  here: that would claim most of the GPU's memory beside the server's."""
  if shutil.which("nvidia-smi"):
    found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, check=False).stdout.strip().splitlines()
    if found:
      return found[0]
  return "cpu"


def server_cli_args(args, spec: str, max_batch: int) -> list[str]:
  return ["--spec", spec, "--budget", args.budget, "--max-batch", str(max_batch),
          "--max-context", str(args.max_prompt + args.max_tokens), "--dtype", args.dtype, "--max-queue", "1024",
          "--attention-impl", args.attention_impl, "--moe-impl", args.moe_impl, "--log-level", "warning"]


def scrape(url: str, name: str) -> float:
  found = re.search(re.escape(name) + r" ([0-9.e+-]+)$", httpx.get(url + "/metrics").text, re.M)
  return float(found.group(1)) if found else 0.0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="benchmarks/results")
  parser.add_argument("--concurrency", default="1,4,16,64")
  parser.add_argument("--requests-per-client", type=int, default=4, help="requests per client (at least 16 in all)")
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--max-prompt", type=int, default=128)
  parser.add_argument("--budget", default="1:32,4:16,16:8,64:4", help="the ddtree server's budget table")
  parser.add_argument("--dtype", default="auto")
  parser.add_argument("--attention-impl", default="xla", choices=KERNEL_IMPLS, help="the target's tree attention")
  parser.add_argument("--moe-impl", default="xla", choices=KERNEL_IMPLS, help="the target's routed experts")
  parser.add_argument("--name", default="bench_serve", help="the results' file names (NAME.json, .md, .png)")
  args = parser.parse_args(argv)
  levels = [int(c) for c in args.concurrency.split(",")]
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  device = device_name()
  rows = []
  for spec in ("none", "ddtree"):
    start = time.perf_counter()
    with server_process(server_cli_args(args, spec, max(levels)), ready_timeout=READY_TIMEOUT_S) as url:
      warm = time.perf_counter() - start
      print(f"{spec}: ready in {warm:.1f} s on {device}", flush=True)
      asyncio.run(run_level(url, held_out_prompts(4, args.max_prompt), 4, min(16, args.max_tokens)))  # first use
      for level in levels:
        prompts = held_out_prompts(max(16, level * args.requests_per_client), args.max_prompt)
        acc = (scrape(url, "ddtree_acceptance_length_sum"), scrape(url, "ddtree_acceptance_length_count"))
        row = asyncio.run(run_level(url, prompts, level, args.max_tokens))
        acc_sum = scrape(url, "ddtree_acceptance_length_sum") - acc[0]
        acc_count = scrape(url, "ddtree_acceptance_length_count") - acc[1]
        row.update(spec=spec, tau=acc_sum / acc_count if acc_count else float("nan"), warmup_s=warm,
                   compiles_after_warmup=scrape(url, "ddtree_compiles_after_warmup_total"))
        rows.append(row)
        print(f"  c={level:3d}: {row['tokens_per_s']:8.0f} tok/s, TTFT p50 {row['ttft_p50_ms']:7.1f} ms, "
              f"ITL p50 {row['itl_p50_ms']:6.2f} ms, tau {row['tau']:.2f}", flush=True)
  for row in rows:
    if row["spec"] == "ddtree":
      base = next(r for r in rows if r["spec"] == "none" and r["concurrency"] == row["concurrency"])
      row["speedup_tokens_per_s"] = row["tokens_per_s"] / base["tokens_per_s"]
  meta = {"device": device, "jax": importlib.metadata.version("jax"), "server": "separate process", "max_tokens": args.max_tokens, "max_prompt": args.max_prompt,
          "budget_table": args.budget, "dtype": args.dtype, "model": "kimi-demo + kimi-demo-dflash",
          "attention_impl": args.attention_impl, "moe_impl": args.moe_impl,
          "command": "PYTHONPATH=. python3 benchmarks/bench_serve.py " + " ".join(sys.argv[1:] if argv is None else argv)}
  (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  lines = [f"# Serving benchmark ({device}, {meta['model']}, dtype {args.dtype})", "",
           f"Greedy, {args.max_tokens} new tokens per request (EOS ignored), prompts up to {args.max_prompt} "
           f"tokens, streaming over loopback HTTP from a client process to `python -m ddtree_jax.serve`; "
           f"ddtree budget table `{args.budget}`; the target's attention "
           f"`{args.attention_impl}`, routed experts `{args.moe_impl}`. Command: "
           f"`{meta['command']}`.", "",
           "| spec | clients | requests | tok/s | speedup | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | "
           "latency p50 ms | tau |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    lines.append(f"| {r['spec']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.0f} | "
                 f"{r.get('speedup_tokens_per_s', 1.0):.2f}x | {r['ttft_p50_ms']:.1f} / {r['ttft_p90_ms']:.1f} / "
                 f"{r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} / {r['itl_p90_ms']:.2f} / {r['itl_p99_ms']:.2f} | "
                 f"{r['latency_p50_ms']:.0f} | {r['tau']:.2f} |")
  (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for spec in ("none", "ddtree"):
      sel = [r for r in rows if r["spec"] == spec]
      axes[0].plot([r["concurrency"] for r in sel], [r["tokens_per_s"] for r in sel], "o-", label=spec)
      axes[1].plot([r["concurrency"] for r in sel], [r["itl_p50_ms"] for r in sel], "o-", label=spec)
    for ax, label in zip(axes, ("output tokens/s", "ITL p50 (ms)")):
      ax.set_xscale("log", base=2)
      ax.set_xlabel("concurrent clients")
      ax.set_ylabel(label)
      ax.legend()
    fig.suptitle(f"python -m ddtree_jax.serve, demo pair, {device}, attention {args.attention_impl}, "
                 f"experts {args.moe_impl}")
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=120)
  except ImportError:
    print("matplotlib not installed: no plot")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
