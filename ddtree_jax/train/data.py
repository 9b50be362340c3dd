"""The demo corpus: Python sources found on this machine, tokenized into uint16 shards.

Nothing can be downloaded, so the text is the running interpreter's standard library and installed
packages. Three steps, each deterministic so that a corpus can be rebuilt byte for byte:

* ``collect_python_files`` walks source roots in sorted order, drops noise and exact duplicates;
* ``build_corpus`` tokenizes the files and writes each split as one token stream cut into shards,
  with a manifest that records every file;
* ``TokenDataset`` serves random training windows from a split, ``held_out_prompts`` prompts cut
  from held-out files for acceptance benchmarks.

Stream layout: every document is preceded by ``<|endoftext|>`` and the stream ends with one, so the
separator doubles as beginning- and end-of-document. The train/held-out split is by file, decided
by the file's content hash, so it is stable across machines and never splits a file.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sysconfig
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer

from ddtree_jax.train import tokenizer as tokenizer_lib

TRAIN = "train"
HELD_OUT = "held_out"
SPLITS = (TRAIN, HELD_OUT)
MANIFEST = "manifest.json"

# Directories not descended into below a root:
# * __pycache__ holds bytecode, and nothing else;
# * site-packages / dist-packages below a root belong to another environment (the base
#   interpreter's packages inside its stdlib dir); the running environment's own package dir is a
#   root of its own;
# * vendored trees are copies of other packages at other versions, near-duplicates that the
#   content hash cannot catch.
DEFAULT_EXCLUDE_DIRS = frozenset(
  {"__pycache__", "site-packages", "dist-packages", "_vendor", "vendor", "_vendored"})
# Larger files are data tables or generated bindings, and would dominate a small corpus.
MAX_FILE_BYTES = 1_000_000
# Lines this long are serialized data (protobuf descriptors, MLIR bytecode, unicode tables).
MAX_LINE_CHARS = 1000
# Generated code announces itself in its first lines; it is repetitive boilerplate that would
# inflate acceptance rates on anything resembling it.
_GENERATED = re.compile(r"auto-?generated|automatically generated|do not edit", re.IGNORECASE)
_HEADER_LINES = 10
# Files per encode_batch call: large enough to keep the tokenizer's threads busy, small enough
# to bound the memory held in token lists.
_ENCODE_BATCH = 256


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """A source file's path, the sha256 hex digest of its bytes, and its (UTF-8) text."""

  path: Path
  sha256: str
  text: str

  @property
  def num_bytes(self) -> int:
    return len(self.text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Collecting sources.


def python_source_roots() -> list[Path]:
  """The running interpreter's stdlib and site-packages directories that exist, deduplicated."""
  paths = sysconfig.get_paths()
  roots = []
  for key in ("stdlib", "purelib", "platlib"):
    root = Path(paths[key]).resolve()
    if root.is_dir() and root not in roots:
      roots.append(root)
  return roots


def collect_python_files(
  roots: Sequence[str | os.PathLike],
  max_files: int | None = None,
  max_bytes: int | None = None,
  exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS,
  max_file_bytes: int = MAX_FILE_BYTES,
) -> list[SourceFile]:
  """The usable ``.py`` files under ``roots``, in a deterministic order.

  Roots are walked in the given order; in each directory, its files in sorted order, then its
  subdirectories in sorted order. Skipped: files in ``exclude_dirs``, larger than
  ``max_file_bytes``, not valid UTF-8, blank, with a line longer than ``MAX_LINE_CHARS``, or
  marked as generated in their first lines; and files whose bytes equal an earlier file's (the
  first path wins). Stops before the file that would make more than ``max_files`` files or
  ``max_bytes`` bytes.
  """
  exclude_dirs = frozenset(exclude_dirs)
  files, seen_paths, seen_hashes, total_bytes = [], set(), set(), 0
  for root in roots:
    for path in _walk_python(Path(root), exclude_dirs):
      if max_files is not None and len(files) >= max_files:
        return files
      # A root nested in an earlier one would otherwise be read twice.
      if path in seen_paths:
        continue
      seen_paths.add(path)
      source = _read_source(path, max_file_bytes)
      if source is None or source.sha256 in seen_hashes:
        continue
      size = source.num_bytes
      if max_bytes is not None and total_bytes + size > max_bytes:
        return files
      seen_hashes.add(source.sha256)
      files.append(source)
      total_bytes += size
  return files


def _walk_python(root: Path, exclude_dirs: frozenset[str]) -> Iterator[Path]:
  for dirpath, dirnames, filenames in os.walk(root):
    # Pruning and sorting in place makes os.walk skip excluded trees and descend in sorted order.
    dirnames[:] = sorted(d for d in dirnames if d not in exclude_dirs)
    for name in sorted(filenames):
      if name.endswith(".py"):
        yield Path(dirpath, name)


def _read_source(path: Path, max_file_bytes: int) -> SourceFile | None:
  """The file as a SourceFile, or None when it is unreadable or noise."""
  try:
    if path.stat().st_size > max_file_bytes:
      return None
    raw = path.read_bytes()
    text = raw.decode("utf-8")
  except (OSError, UnicodeDecodeError):
    return None
  if not text.strip():
    return None
  lines = text.splitlines()
  if max(map(len, lines)) > MAX_LINE_CHARS:
    return None
  if _GENERATED.search("\n".join(lines[:_HEADER_LINES])):
    return None
  return SourceFile(path, hashlib.sha256(raw).hexdigest(), text)


def split_of(sha256: str, held_out_fraction: float) -> str:
  """``HELD_OUT`` for a ``held_out_fraction`` of content hashes, ``TRAIN`` for the rest."""
  # The leading 64 bits of a sha256 are uniform: comparing them to the fraction of 2**64 is a
  # fair coin that depends on the content only.
  return HELD_OUT if int(sha256[:16], 16) < held_out_fraction * 2**64 else TRAIN


# ---------------------------------------------------------------------------------------------
# Writing the corpus.


class _ShardWriter:
  """Appends tokens to one split's stream and writes it as ``{split}_{i:04d}.npy`` shards."""

  def __init__(self, out_dir: Path, split: str, shard_tokens: int):
    self._out_dir, self._split, self._shard_tokens = out_dir, split, shard_tokens
    self._pending: list[np.ndarray] = []
    self._pending_len = 0
    self.num_tokens = 0
    self.shards: list[dict] = []

  def append(self, tokens: np.ndarray) -> None:
    self._pending.append(tokens)
    self._pending_len += len(tokens)
    self.num_tokens += len(tokens)
    while self._pending_len >= self._shard_tokens:
      pending = np.concatenate(self._pending)
      self._write(pending[:self._shard_tokens])
      self._pending = [pending[self._shard_tokens:]]
      self._pending_len = len(self._pending[0])

  def close(self) -> None:
    if self._pending_len:
      self._write(np.concatenate(self._pending))
    self._pending, self._pending_len = [], 0

  def _write(self, shard: np.ndarray) -> None:
    name = f"{self._split}_{len(self.shards):04d}.npy"
    np.save(self._out_dir / name, shard)
    self.shards.append({"name": name, "num_tokens": len(shard)})


def build_corpus(
  files: Sequence[SourceFile],
  tokenizer: Tokenizer,
  out_dir: str | os.PathLike,
  held_out_fraction: float = 0.02,
  shard_tokens: int = 4_000_000,
) -> dict:
  """Tokenizes ``files`` into ``out_dir`` (new or empty) and returns the manifest it writes.

  Writes ``{split}_{i:04d}.npy`` uint16 shards and ``manifest.json`` (last, so that its presence
  marks a complete corpus). The same files and tokenizer give byte-identical outputs.
  """
  vocab_size = tokenizer.get_vocab_size()
  if vocab_size > np.iinfo(np.uint16).max + 1:
    raise ValueError(f"vocab size {vocab_size} does not fit uint16 shards")
  if shard_tokens < 1:  # a shard would take no tokens, and the writer would write empty ones forever
    raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
  if not 0 <= held_out_fraction < 1:
    raise ValueError(f"held_out_fraction must lie in [0, 1), got {held_out_fraction}")
  if not files:
    raise ValueError("no source files to build a corpus from (check the roots)")
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  if any(out_dir.iterdir()):
    raise FileExistsError(f"{out_dir} is not empty; stale shards would mix with new ones")
  eot = np.array([tokenizer_lib.special_token_id(tokenizer, "<|endoftext|>")], np.uint16)
  writers = {split: _ShardWriter(out_dir, split, shard_tokens) for split in SPLITS}
  entries = []
  for start in range(0, len(files), _ENCODE_BATCH):
    chunk = files[start:start + _ENCODE_BATCH]
    encodings = tokenizer.encode_batch_fast([f.text for f in chunk], add_special_tokens=False)
    for source, encoding in zip(chunk, encodings):
      split = split_of(source.sha256, held_out_fraction)
      ids = np.asarray(encoding.ids, np.uint16)
      writer = writers[split]
      entries.append({
        "path": str(source.path),
        "sha256": source.sha256,
        "bytes": source.num_bytes,
        "split": split,
        "num_tokens": len(ids),
        # Stream index of the <|endoftext|> before the document; its tokens follow it.
        "offset": writer.num_tokens,
      })
      writer.append(eot)
      writer.append(ids)
  splits = {}
  for split, writer in writers.items():
    if writer.num_tokens:
      writer.append(eot)
    writer.close()
    mine = [e for e in entries if e["split"] == split]
    splits[split] = {
      "files": len(mine),
      "bytes": sum(e["bytes"] for e in mine),
      "num_tokens": writer.num_tokens,
      "shards": writer.shards,
    }
  manifest = {
    "layout": "each split is one uint16 token stream, <|endoftext|> before every document and "
              "once at the end, cut into consecutive shards",
    "tokenizer_sha256": tokenizer_lib.tokenizer_sha256(tokenizer),
    "vocab_size": vocab_size,
    "eot_id": int(eot[0]),
    "held_out_fraction": held_out_fraction,
    "shard_tokens": shard_tokens,
    "splits": splits,
    "files": entries,
  }
  (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
  return manifest


def read_manifest(corpus_dir: str | os.PathLike) -> dict:
  return json.loads((Path(corpus_dir) / MANIFEST).read_text())


# ---------------------------------------------------------------------------------------------
# Reading the corpus.


class TokenStream:
  """One split of a corpus as a single token stream over its memory-mapped shards.

  Attributes:
    manifest: the corpus manifest.
    documents: the split's manifest file entries, in stream order.
    num_tokens: the stream's length.
  """

  def __init__(self, corpus_dir: str | os.PathLike, split: str):
    corpus_dir = Path(corpus_dir)
    self.manifest = read_manifest(corpus_dir)
    self.documents = [f for f in self.manifest["files"] if f["split"] == split]
    self._shards = []
    for shard in self.manifest["splits"][split]["shards"]:
      tokens = np.load(corpus_dir / shard["name"], mmap_mode="r")
      if tokens.shape != (shard["num_tokens"],):
        raise ValueError(f"{shard['name']} holds {tokens.shape} tokens, the manifest says "
                         f"{shard['num_tokens']}")
      self._shards.append(tokens)
    self._starts = np.cumsum([0] + [len(s) for s in self._shards])
    self.num_tokens = int(self._starts[-1])

  def read(self, start: int, length: int) -> np.ndarray:
    """int32[length]: the stream's tokens from ``start``, across shard boundaries."""
    if start < 0 or length < 0 or start + length > self.num_tokens:
      raise IndexError(f"[{start}, {start + length}) is outside [0, {self.num_tokens})")
    out = np.empty(length, np.int32)
    shard = int(np.searchsorted(self._starts, start, side="right")) - 1
    done = 0
    while done < length:
      lo = start + done - int(self._starts[shard])
      take = min(length - done, len(self._shards[shard]) - lo)
      out[done:done + take] = self._shards[shard][lo:lo + take]
      done += take
      shard += 1
    return out


class TokenDataset:
  """Random training windows from one split.

  ``batch(step)`` draws its window offsets from (seed, step) alone, so a run resumed at step s
  sees exactly the batches it would have seen, with no data-loader state to checkpoint.
  """

  def __init__(self, corpus_dir: str | os.PathLike, split: str, seq_len: int, batch_size: int,
               seed: int):
    self.stream = TokenStream(corpus_dir, split)
    if self.stream.num_tokens < seq_len + 1:
      raise ValueError(f"{split} has {self.stream.num_tokens} tokens, fewer than one window of "
                       f"{seq_len + 1}")
    self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

  @property
  def num_tokens(self) -> int:
    return self.stream.num_tokens

  def batch(self, step: int) -> np.ndarray:
    """int32[batch_size, seq_len + 1]: inputs are ``[:, :-1]``, next-token targets ``[:, 1:]``."""
    rng = np.random.default_rng([self.seed, step])
    # The last window that fits starts at num_tokens - (seq_len + 1); the bound is exclusive.
    starts = rng.integers(0, self.num_tokens - self.seq_len, size=self.batch_size)
    return np.stack([self.stream.read(int(s), self.seq_len + 1) for s in starts])


def held_out_prompts(
  corpus_dir: str | os.PathLike,
  n: int,
  prompt_tokens: int,
  min_continuation: int,
  offset: int = 0,
  seed: int = 0,
) -> list[list[int]]:
  """``n`` prompts of ``prompt_tokens`` tokens from distinct held-out files, for benchmarks.

  A prompt starts ``offset`` tokens after a document's leading ``<|endoftext|>`` (offset 0: the
  prompt opens with it, as the document did in training) and its document continues for at least
  ``min_continuation`` tokens after it. Documents are picked by a permutation seeded by ``seed``.
  """
  stream = TokenStream(corpus_dir, HELD_OUT)
  need = offset + prompt_tokens + min_continuation
  # A document spans 1 + num_tokens stream tokens, counting its leading separator.
  eligible = [d for d in stream.documents if 1 + d["num_tokens"] >= need]
  if len(eligible) < n:
    raise ValueError(f"only {len(eligible)} held-out documents have {need} tokens, {n} wanted")
  order = np.random.default_rng(seed).permutation(len(eligible))[:n]
  return [stream.read(eligible[i]["offset"] + offset, prompt_tokens).tolist() for i in order]


# ---------------------------------------------------------------------------------------------
# Command line.


def main_tokenizer(argv: Sequence[str] | None = None) -> None:
  """Trains the tokenizer on the train split of the collected sources."""
  parser = argparse.ArgumentParser(prog="python -m ddtree_jax.train tokenizer", description=main_tokenizer.__doc__)
  parser.add_argument("--out", required=True, help="tokenizer.json path to write")
  parser.add_argument("--vocab-size", type=int, default=8192)
  _add_source_args(parser)
  args = parser.parse_args(argv)
  if not Path(args.out).parent.is_dir():  # found only after training otherwise
    parser.error(f"--out {args.out}: its directory does not exist")
  if args.vocab_size < 1 or args.vocab_size > np.iinfo(np.uint16).max + 1:  # a corpus stores ids as uint16
    parser.error(f"--vocab-size must lie in [1, 65536], got {args.vocab_size}")
  files = _collect(args)
  # Held-out files stay unseen by the tokenizer too.
  train = [f for f in files if split_of(f.sha256, args.held_out_fraction) == TRAIN]
  began = time.perf_counter()
  tok = tokenizer_lib.train_tokenizer((f.text for f in train), args.vocab_size, args.out)
  print(f"trained vocab {tok.get_vocab_size()} on {len(train)} files "
        f"({sum(f.num_bytes for f in train):,} bytes) in {time.perf_counter() - began:.1f}s "
        f"-> {args.out}")


def main_corpus(argv: Sequence[str] | None = None) -> None:
  """Tokenizes the collected sources into a corpus directory."""
  parser = argparse.ArgumentParser(prog="python -m ddtree_jax.train corpus", description=main_corpus.__doc__)
  parser.add_argument("--tokenizer", required=True, help="tokenizer.json path")
  parser.add_argument("--out", required=True, help="corpus directory to create")
  parser.add_argument("--shard-tokens", type=int, default=4_000_000)
  _add_source_args(parser)
  args = parser.parse_args(argv)
  if args.shard_tokens < 1:
    parser.error(f"--shard-tokens must be positive, got {args.shard_tokens}")
  if not Path(args.tokenizer).is_file():
    parser.error(f"--tokenizer {args.tokenizer} is not a file")
  files = _collect(args)
  if not files:
    raise SystemExit("error: the roots hold no usable .py files: nothing to build a corpus from")
  began = time.perf_counter()
  try:
    manifest = build_corpus(files, tokenizer_lib.load_tokenizer(args.tokenizer), args.out,
                            args.held_out_fraction, args.shard_tokens)
  except (FileExistsError, ValueError) as err:  # a non-empty --out, or a tokenizer too large for uint16
    raise SystemExit(f"error: {err}") from None
  print(f"built {args.out} in {time.perf_counter() - began:.1f}s")
  for split, info in manifest["splits"].items():
    print(f"  {split}: {info['files']} files, {info['bytes']:,} bytes, {info['num_tokens']:,} "
          f"tokens in {len(info['shards'])} shards")


def _add_source_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--root", action="append", default=None,
                      help="source root to walk (repeatable; default: python_source_roots())")
  parser.add_argument("--max-files", type=int, default=None)
  parser.add_argument("--max-bytes", type=int, default=None)
  parser.add_argument("--held-out-fraction", type=float, default=0.02)


def _collect(args: argparse.Namespace) -> list[SourceFile]:
  missing = [root for root in args.root or () if not Path(root).is_dir()]
  if missing:  # os.walk of a missing path yields nothing: a mistyped root would build an empty corpus
    raise SystemExit(f"error: --root {missing[0]} is not a directory")
  if not 0 <= args.held_out_fraction < 1:
    raise SystemExit(f"error: --held-out-fraction must lie in [0, 1), got {args.held_out_fraction}")
  began = time.perf_counter()
  files = collect_python_files(args.root or python_source_roots(), args.max_files, args.max_bytes)
  print(f"collected {len(files)} files ({sum(f.num_bytes for f in files):,} bytes) in "
        f"{time.perf_counter() - began:.1f}s")
  return files
