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
import shutil
import sys
import time
from pathlib import Path

import jax
from flax import nnx

from ddtree_jax.train import data, loop
from ddtree_jax.train import tokenizer as tokenizer_lib
from models import dflash, kimi, loading
from models.config import ConfigError, KimiConfig

# Presets by the corpus's vocabulary size: the demo keeps its 8192 (the shipped tokenizer's), the
# tiny model takes the corpus's (any tokenizer trained here has more than its 256 bytes). BOS and
# EOS are <|endoftext|>, id 0 in every tokenizer trained here, as in the demo preset (tiny's own
# 1 and 2 are <|mask|> and <|im_system|> there: an export would stop at a turn marker).
TARGET_PRESETS = {"demo": lambda vocab_size: KimiConfig.demo(),
                  "tiny": lambda vocab_size: KimiConfig.tiny(vocab_size=vocab_size, dtype="bfloat16",
                                                             param_dtype="float32", bos_token_id=0, eos_token_id=0)}
# What a tokenizer trained here needs beside tokenizer.json to serve: documents start with
# <|endoftext|> in the corpus, so prompts do too.
EXPORT_TOKENIZER_CONFIG = {"add_bos_token": True, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}


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
  dataset = data.TokenDataset(args.corpus, data.TRAIN, tc.seq_len, tc.batch_size, seed=tc.seed)
  cfg = TARGET_PRESETS[args.preset](dataset.stream.manifest["vocab_size"])
  if dataset.stream.manifest["vocab_size"] > cfg.vocab_size:
    raise SystemExit(f"error: corpus vocabulary {dataset.stream.manifest['vocab_size']} exceeds the "
                     f"preset's {cfg.vocab_size}")
  model = kimi.init_model(cfg, tc.seed)
  summary = target_train.train_target(model, tc, dataset, out, show_progress=not args.no_progress)
  summary["params"] = kimi.param_count(model)
  summary["corpus_train_tokens"] = dataset.num_tokens
  return model, summary


def run_drafter(args, target: kimi.KimiModel, tc: loop.TrainConfig, out: Path, mask_token_id: int,
                target_tokenizer=None):
  from ddtree_jax.train import drafter as drafter_train  # pylint: disable=import-outside-toplevel
  cfg = demo_drafter_config(target.cfg, mask_token_id)
  dataset = data.TokenDataset(args.corpus, data.TRAIN, tc.seq_len, tc.batch_size, seed=tc.seed + 1)
  manifest = dataset.stream.manifest
  if manifest["vocab_size"] > target.cfg.vocab_size:  # ids past the target's embedding read NaN
    raise SystemExit(f"error: corpus vocabulary {manifest['vocab_size']} exceeds the target's {target.cfg.vocab_size}")
  if target_tokenizer is not None and tokenizer_lib.tokenizer_sha256(target_tokenizer) != manifest["tokenizer_sha256"]:
    raise SystemExit(f"error: the corpus {args.corpus} was tokenised by another tokenizer than the target's "
                     "tokenizer.json (tokenizer_sha256 differs): the drafter would learn other tokens")
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
  p.add_argument("--tokenizer", default=None, help="the corpus's tokenizer.json, copied into the export "
                 "(the server needs it to read text; checked against the corpus)")

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
  p.add_argument("--tokenizer", default=None, help="the corpus's tokenizer.json, copied into the target's "
                 "export (the server needs it to read text; checked against the corpus)")

  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in ("tokenizer", "corpus"):
    (data.main_tokenizer if argv[0] == "tokenizer" else data.main_corpus)(argv[1:])
    return 0
  args = parser.parse_args(argv)
  try:
    return _run(args, argv, parser)
  except (FloatingPointError, loop.RunMismatch, ConfigError) as err:  # a diverged run, a resume with other
    print(f"error: {err}", file=sys.stderr)  # settings, or a model setting (e.g. --mask-token-id) refused
    return 1


def _export_target(model: kimi.KimiModel, directory, args) -> None:
  loading.save_kimi(model, directory)
  if getattr(args, "tokenizer", None):
    destination = Path(directory) / "tokenizer.json"
    if not (destination.exists() and destination.samefile(args.tokenizer)):  # --tokenizer may already be there
      shutil.copyfile(args.tokenizer, destination)
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(EXPORT_TOKENIZER_CONFIG, indent=1) + "\n")


def _check_tokenizer(args, parser) -> None:
  """``--tokenizer`` is the corpus's, before any training (its copy is what the export serves with)."""
  if not getattr(args, "tokenizer", None):
    return
  manifest = data.TokenStream(args.corpus, data.TRAIN).manifest
  try:
    sha = tokenizer_lib.tokenizer_sha256(tokenizer_lib.load_tokenizer(args.tokenizer))
  except Exception as err:  # pylint: disable=broad-except  (a missing or unreadable file)
    parser.error(f"--tokenizer {args.tokenizer}: {err}")
  if sha != manifest["tokenizer_sha256"]:
    parser.error(f"--tokenizer {args.tokenizer} is not the tokenizer {args.corpus} was built with")


def _train_configs(args, parser) -> tuple[loop.TrainConfig, loop.TrainConfig | None]:
  """The run's TrainConfig (and demo's drafter's), checked before anything trains: a drafter setting
  refused only after the target's run would waste it."""
  try:
    tc = _tc(args)
  except ValueError as err:
    parser.error(f"{err} (flags --steps, --batch-size, --seq-len, --lr, --warmup)")
  if args.command != "demo":
    return tc, None
  try:
    return tc, _tc(args, prefix="drafter_")
  except ValueError as err:
    parser.error(f"the drafter's {err} (flags --drafter-steps, --drafter-batch-size, --drafter-seq-len, "
                 "--drafter-lr, --drafter-warmup)")


def _check_inputs(args, parser) -> None:
  """The corpus and (for ``drafter``) the target exist, before --out does."""
  if not (Path(args.corpus) / "manifest.json").is_file():
    parser.error(f"--corpus {args.corpus}: no corpus there (no manifest.json; build one with "
                 "`python -m ddtree_jax.train corpus`)")
  if args.command == "drafter":
    try:
      loading.resolve_model_dir(args.target)
    except FileNotFoundError as err:
      parser.error(f"--target: {err}")


def _run(args, argv, parser) -> int:
  # Before --out exists: a refused command leaves nothing behind.
  _check_inputs(args, parser)
  _check_tokenizer(args, parser)
  tc, drafter_tc = _train_configs(args, parser)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  if args.command == "target":
    model, summary = run_target(args, tc, out)
    if args.export:
      _export_target(model, args.export, args)
    print(json.dumps(summary))
  elif args.command == "drafter":
    target_dir = loading.resolve_model_dir(args.target)
    target = loading.load_kimi(target_dir, dtype="bfloat16", param_dtype="float32")
    tokenizer_file = target_dir / "tokenizer.json"
    target_tokenizer = tokenizer_lib.load_tokenizer(tokenizer_file) if tokenizer_file.exists() else None
    model, summary = run_drafter(args, target, tc, out, args.mask_token_id, target_tokenizer)
    if args.export:
      loading.save_dflash(model, args.export)
    print(json.dumps(summary))
  else:
    target, target_summary = run_target(args, tc, out)
    if target_summary["steps"] < tc.steps:  # --max-seconds ran out: the drafter must learn the finished target
      print(f"the target stopped at step {target_summary['steps']} of {tc.steps} (--max-seconds); nothing is "
            "exported and the drafter does not train yet: run the same command again to resume", file=sys.stderr)
      return 2
    _export_target(target, out / args.name, args)
    # The drafter learns the target as it is served: its bf16 export, not the float32 weights in memory.
    target = loading.load_kimi(out / args.name, dtype="bfloat16", param_dtype="float32")
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
