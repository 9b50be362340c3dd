"""A byte-level BPE tokenizer for the demo models, with fixed special-token ids.

Byte-level (the ByteLevel pre-tokenizer maps every byte to a symbol, the decoder maps it back, and
all 256 byte symbols are in the initial alphabet), so any UTF-8 text encodes without unknown tokens
and ``decode(encode(text)) == text`` exactly.

Text is always encoded literally: a source file that contains the string ``<|endoftext|>`` gets
the bytes of that string, not the separator id, so documents cannot forge boundaries or chat
markers. Special tokens enter a sequence only by id (``special_token_id``). The ``tokenizers``
library does not save that setting in tokenizer.json, so load through ``load_tokenizer``.
"""

import hashlib
import os
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Fixed ids 0..6, in this order. <|endoftext|> separates documents and ends generation; <|mask|>
# fills the DFlash drafter's block positions still to be predicted; the rest frame chat turns.
SPECIAL_TOKENS = (
  "<|endoftext|>",
  "<|mask|>",
  "<|im_system|>",
  "<|im_user|>",
  "<|im_assistant|>",
  "<|im_middle|>",
  "<|im_end|>",
)

# A pair must occur twice to be merged: merges seen once only memorise single documents.
_MIN_FREQUENCY = 2


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike) -> Tokenizer:
  """Trains byte-level BPE on ``texts`` and saves it as JSON to ``out_path`` (a file path).

  Deterministic: the same texts in the same order give the same tokenizer.json.
  """
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=_MIN_FREQUENCY,
    special_tokens=list(SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  for i, name in enumerate(SPECIAL_TOKENS):
    assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
  tok.save(os.fspath(out_path))
  return _literal(tok)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """Loads a tokenizer.json written by ``train_tokenizer``."""
  return _literal(Tokenizer.from_file(os.fspath(path)))


def special_token_id(tok: Tokenizer, name: str) -> int:
  """The id of special token ``name`` (one of ``SPECIAL_TOKENS``)."""
  if name not in SPECIAL_TOKENS:
    raise KeyError(f"{name!r} is not one of {SPECIAL_TOKENS}")
  return tok.token_to_id(name)


def encode(tok: Tokenizer, text: str) -> list[int]:
  """Token ids of ``text``, read literally (no special tokens added or recognised).

  Through ``encode_batch``, which releases the GIL while it runs (``encode`` holds it: a 1 MB
  prompt then stops every other Python thread, a server's event loop and engine thread
  included, for about half a second); the same ids."""
  return tok.encode_batch([text], add_special_tokens=False)[0].ids


def decode(tok: Tokenizer, ids: Sequence[int]) -> str:
  """The text of ``ids``; special tokens are kept as their strings so nothing is dropped."""
  return tok.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_sha256(tok: Tokenizer) -> str:
  """A hash of the tokenizer's JSON, recorded with a corpus so a mismatched tokenizer is caught."""
  return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def _literal(tok: Tokenizer) -> Tokenizer:
  tok.encode_special_tokens = True
  return tok
