"""``python -m ddtree_jax.train {tokenizer,corpus,target,drafter,demo}``.

    tokenizer  train the byte-level BPE tokenizer on Python sources found on this machine
    corpus     tokenise those sources into uint16 shards + manifest (held-out split by file)
    target     pre-train a Kimi-architecture target (AdamW, warm-up + cosine, bf16 over fp32)
    drafter    train a DFlash drafter against a frozen target
    demo       target then drafter in one process (the shipped pair's recipe), both exported

Every training command resumes from its newest orbax checkpoint in ``--out`` and logs one JSON
line per logged step to ``--out/<name>_log.jsonl``.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
from flax import nnx

from ddtree_jax.train import data, loop
from models import dflash, kimi, loading
from models.config import KimiConfig

TARGET_PRESETS = {"demo": KimiConfig.demo, "tiny": lambda: KimiConfig.tiny(dtype="bfloat16", param_dtype="float32")}


def demo_drafter_config(target_cfg: KimiConfig, mask_token_id: int = 1) -> dflash.DFlashConfig:
  """The shipped drafter: 2 Qwen3-style layers, 6 heads of 64 (2 KV heads), block 16 (~3.5M)."""
  return dflash.DFlashConfig.for_target(
      target_cfg, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
      intermediate_size=1024, mask_token_id=mask_token_id, dtype="bfloat16", param_dtype="float32")


def _train_args(parser, *, steps, batch, seq, lr, warmup):
  parser.add_argument("--corpus", required=True, help="corpus directory (python -m ddtree_jax.train corpus)")
  parser.add_argument("--out", required=True, help="run directory: checkpoints, logs, export")
  parser.add_argument("--steps", type=int, default=steps)
  parser.add_argument("--batch-size", type=int, default=batch)
  parser.add_argument("--seq-len", type=int, default=seq)
  parser.add_argument("--lr", type=float, default=lr)
  parser.add_argument("--warmup", type=int, default=warmup)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-seconds", type=float, default=None, help="stop early (and checkpoint) at this wall time")
  parser.add_argument("--no-progress", action="store_true")


def _tc(args, prefix="") -> loop.TrainConfig:
  get = lambda name: getattr(args, prefix + name)
  return loop.TrainConfig(steps=get("steps"), batch_size=get("batch_size"), seq_len=get("seq_len"),
                          learning_rate=get("lr"), warmup_steps=get("warmup"), seed=args.seed,
                          max_seconds=get("max_seconds"), checkpoint_every=max(get("steps") // 4, 1))


def run_target(args, tc: loop.TrainConfig, out: Path) -> tuple[kimi.KimiModel, dict]:
  from ddtree_jax.train import target as target_train  # pylint: disable=import-outside-toplevel
  cfg = TARGET_PRESETS[args.preset]()
  dataset = data.TokenDataset(args.corpus, data.TRAIN, tc.seq_len, tc.batch_size, seed=tc.seed)
  if dataset.stream.manifest["vocab_size"] > cfg.vocab_size:
    raise SystemExit(f"error: corpus vocabulary {dataset.stream.manifest['vocab_size']} exceeds the "
                     f"preset's {cfg.vocab_size}")
  model = kimi.init_model(cfg, tc.seed)
  summary = target_train.train_target(model, tc, dataset, out, show_progress=not args.no_progress)
  summary["params"] = kimi.param_count(model)
  summary["corpus_train_tokens"] = dataset.num_tokens
  return model, summary


def run_drafter(args, target: kimi.KimiModel, tc: loop.TrainConfig, out: Path, mask_token_id: int):
  from ddtree_jax.train import drafter as drafter_train  # pylint: disable=import-outside-toplevel
  cfg = demo_drafter_config(target.cfg, mask_token_id)
  dataset = data.TokenDataset(args.corpus, data.TRAIN, tc.seq_len, tc.batch_size, seed=tc.seed + 1)
  model = dflash.init_dflash(cfg, tc.seed)
  summary = drafter_train.train_drafter(model, target, tc, dataset, out, num_anchors=args.anchors,
                                        show_progress=not args.no_progress)
  summary["params"] = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return model, summary


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ddtree_jax.train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("tokenizer", help="train the tokenizer (see --help)", add_help=False)
  sub.add_parser("corpus", help="build the token corpus (see --help)", add_help=False)

  p = sub.add_parser("target", help="pre-train a target")
  p.add_argument("--preset", default="demo", choices=sorted(TARGET_PRESETS))
  _train_args(p, steps=3000, batch=64, seq=512, lr=3e-3, warmup=100)
  p.add_argument("--export", default=None, help="write the trained target here (HF layout)")

  p = sub.add_parser("drafter", help="train a DFlash drafter against a frozen target")
  p.add_argument("--target", required=True, help="target checkpoint directory or bundled name")
  _train_args(p, steps=3000, batch=32, seq=512, lr=2e-3, warmup=100)
  p.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
  p.add_argument("--mask-token-id", type=int, default=1)
  p.add_argument("--export", default=None, help="write the trained drafter here (DFlash layout)")

  p = sub.add_parser("demo", help="target then drafter in one process, both exported")
  p.add_argument("--preset", default="demo", choices=sorted(TARGET_PRESETS))
  _train_args(p, steps=3000, batch=64, seq=512, lr=3e-3, warmup=100)
  p.add_argument("--drafter-steps", type=int, default=3000)
  p.add_argument("--drafter-batch-size", type=int, default=32)
  p.add_argument("--drafter-seq-len", type=int, default=512)
  p.add_argument("--drafter-lr", type=float, default=2e-3)
  p.add_argument("--drafter-warmup", type=int, default=100)
  p.add_argument("--drafter-max-seconds", type=float, default=None)
  p.add_argument("--anchors", type=int, default=16)
  p.add_argument("--mask-token-id", type=int, default=1)
  p.add_argument("--name", default="kimi-demo", help="export names: NAME and NAME-dflash")

  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in ("tokenizer", "corpus"):
    (data.main_tokenizer if argv[0] == "tokenizer" else data.main_corpus)(argv[1:])
    return 0
  args = parser.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  if args.command == "target":
    model, summary = run_target(args, _tc(args), out)
    if args.export:
      loading.save_kimi(model, args.export)
    print(json.dumps(summary))
  elif args.command == "drafter":
    target = loading.load_kimi(args.target, dtype="bfloat16", param_dtype="float32")
    model, summary = run_drafter(args, target, _tc(args), out, args.mask_token_id)
    if args.export:
      loading.save_dflash(model, args.export)
    print(json.dumps(summary))
  else:
    target, target_summary = run_target(args, _tc(args), out)
    loading.save_kimi(target, out / args.name)
    drafter_tc = _tc(args, prefix="drafter_")
    drafter, drafter_summary = run_drafter(args, target, drafter_tc, out, args.mask_token_id)
    loading.save_dflash(drafter, out / f"{args.name}-dflash")
    summary = {"target": target_summary, "drafter": drafter_summary, "wall_s": time.perf_counter() - t0,
               "argv": argv}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "target"} | {
        "target_loss": target_summary["final_loss"], "target_steps": target_summary["steps"]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
