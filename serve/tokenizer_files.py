"""A checkpoint's tokenizer, from either file format a Kimi-architecture checkpoint ships.

- ``tokenizer.json`` (Hugging Face ``tokenizers``): the demo pair and most converted checkpoints.
- ``tiktoken.model`` (Kimi K2 / K2.5 / K2.6 as released): BPE ranks read by ``tiktoken``, Kimi's
  pre-tokeniser pattern, and 256 reserved special ids after the ranks, named by
  ``tokenizer_config.json``'s ``added_tokens_decoder`` (``<|reserved_token_{id}|>`` otherwise), as
  the checkpoint's own ``tokenization_kimi.py`` builds them.

Both give ``TextCodec`` the same small interface: literal encoding (special-token spellings stay
text), parsing encoding (for a chat template's rendering), decoding without special tokens, ids by
name, and one token's bytes (for log-probabilities, where a token may be part of a character).
Encoding and decoding release the GIL in both libraries.
"""

import base64
import binascii
import functools
import json
import os
import re
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

from ddtree_jax.train import tokenizer as tokenizer_lib

# Kimi's pre-tokeniser (tokenization_kimi.py's pat_str, K2 through K2.6): Han runs, cased words
# outside Han with English contractions, numbers of at most 3 digits, punctuation runs, newlines
# and other whitespace. ``&&`` intersects character classes (tiktoken's regex engine supports it).
KIMI_PATTERN_PIECES = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PATTERN = "|".join(KIMI_PATTERN_PIECES)
NUM_RESERVED_SPECIAL_TOKENS = 256
# tiktoken's regex matching recurses per character of one pre-token and its BPE is quadratic in
# it (openai/tiktoken#195), so, as tokenization_kimi.py does, text goes in pieces of at most
# 400,000 characters, each cut where a run of whitespace or of other characters passes 25,000.
_MAX_CHUNK_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
  """{character: byte} of byte-level BPE (GPT-2's convention, which ``tokenizers``' ByteLevel
  follows): printable Latin-1 bytes stand for themselves, the other 68 for characters from U+0100
  on, in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  others = [b for b in range(256) if b not in printable]
  return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _uses_byte_level(component) -> bool:
  if not isinstance(component, dict):
    return False
  return component.get("type") == "ByteLevel" or any(_uses_byte_level(c) for c in component.get("decoders") or ())


class TokenizerFileError(ValueError):
  """A checkpoint's tokenizer files are missing or inconsistent; the message names the file."""


# Tokens that must never come from a user's text, whatever tokenizer.json says of them: the
# turn markers of Kimi's format (the built-in template's) and tokenizer_config.json's named tokens.
CHAT_MARKERS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def named_special_tokens(config: dict) -> dict[str, str]:
  """tokenizer_config.json's named special tokens ({"bos_token": "<s>", ...}); Hugging Face writes
  each as a string or as an AddedToken dict ({"content": "<s>", ...})."""
  named = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items() if k in SPECIAL_TOKEN_KEYS}
  return {k: v for k, v in named.items() if isinstance(v, str) and v}


class HFTokenizer:
  """``tokenizer.json`` through Hugging Face ``tokenizers``.

  ``control_tokens``: spellings to treat as special even where tokenizer.json adds them as plain
  tokens (some conversions do): literal encoding would match those in a user's text, which could
  then forge a turn marker or an EOS. ``CHAT_MARKERS`` always are.
  """

  def __init__(self, tokenizer: Tokenizer, control_tokens=()):
    # Copies: the encode_special_tokens switch is the tokenizer's state, which tokenizer.json does
    # not keep, so the caller's object is left as it was.
    spec = json.loads(tokenizer.to_str())
    control = set(CHAT_MARKERS) | set(control_tokens)
    for added in spec.get("added_tokens") or ():
      if added.get("content") in control:
        added["special"] = True
    self.tokenizer = Tokenizer.from_str(json.dumps(spec))
    self.tokenizer.encode_special_tokens = True  # literal: special spellings stay text
    self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
    self.special_spellings = tuple(t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                                   if t.special and t.content)
    self._added_ids = frozenset(self.tokenizer.get_added_tokens_decoder())
    self._byte_level = _uses_byte_level(spec.get("decoder"))

  def token_bytes(self, token_id: int) -> bytes:
    """One token's bytes: an added token's spelling; a byte-level BPE token's bytes exactly (a
    piece of a multi-byte character included); otherwise the token decoded alone. b"" for an id
    the tokenizer does not have."""
    piece = self.tokenizer.id_to_token(int(token_id))
    if piece is None:
      return b""
    if int(token_id) in self._added_ids:
      return piece.encode("utf-8")
    if self._byte_level:
      alphabet = _byte_level_alphabet()
      if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return self.tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

  def encode(self, text: str) -> list[int]:
    return tokenizer_lib.encode(self.tokenizer, text)

  @functools.cached_property
  def _parsing(self) -> Tokenizer:
    parsing = Tokenizer.from_str(self.tokenizer.to_str())
    parsing.encode_special_tokens = False
    return parsing

  def encode_parsing_special(self, text: str) -> list[int]:
    return tokenizer_lib.encode(self._parsing, text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

  def decode_long(self, ids: Sequence[int]) -> str:
    # decode_batch releases the GIL (decode holds it, ~75 ms for a megabyte's ids).
    return self.tokenizer.decode_batch([[int(i) for i in ids]], skip_special_tokens=True)[0]

  def token_to_id(self, name: str) -> int | None:
    return self.tokenizer.token_to_id(name)


class KimiTiktokenTokenizer:
  """``tiktoken.model`` with Kimi's pattern and reserved special ids (see the module docstring).

  Args:
    ranks_path: the ``tiktoken.model`` file (one ``base64(token bytes) rank`` line per token).
    special_names: {id: name} of special ids to name (``added_tokens_decoder``); every other id of
      the reserved block is ``<|reserved_token_{id}|>``.
    text_ids: named ids that ``added_tokens_decoder`` marks ``"special": false`` (e.g. a reasoning
      model's ``<think>``): as the ``tokenizer.json`` backend treats such added tokens, ``decode``
      gives their names as text (it leaves special ids out), and ``encode`` reads their spellings
      as their ids even in literal text (they cannot be turn markers: ``load`` never lists those).
  """

  def __init__(self, ranks_path, special_names: dict[int, str] | None = None, text_ids=()):
    import tiktoken  # pylint: disable=import-outside-toplevel
    ranks = read_ranks(ranks_path)
    num_base = len(ranks)
    if sorted(ranks.values()) != list(range(num_base)):
      raise TokenizerFileError(f"{ranks_path}: ranks must be 0..{num_base - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # tiktoken's BPE starts from single bytes: encoding one it lacks panics (not an Exception)
      raise TokenizerFileError(f"{ranks_path}: {len(missing)} of the 256 single bytes have no rank "
                               f"(the first: {missing[0]:#04x}); every byte must be a token")
    special_names = dict(special_names or {})
    outside = sorted(i for i in special_names if not num_base <= i < num_base + NUM_RESERVED_SPECIAL_TOKENS)
    if outside:
      raise TokenizerFileError(
          f"tokenizer_config.json names special id {outside[0]} outside the reserved block "
          f"[{num_base}, {num_base + NUM_RESERVED_SPECIAL_TOKENS}) after {ranks_path}'s {num_base} ranks")
    self.special_ids = {special_names.get(i, f"<|reserved_token_{i}|>"): i
                        for i in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)}
    self._special_names = {i: name for name, i in self.special_ids.items()}
    if len(self.special_ids) != NUM_RESERVED_SPECIAL_TOKENS:
      raise TokenizerFileError("tokenizer_config.json gives two special ids the same name")
    if "" in self.special_ids:  # it would "occur" in every text
      raise TokenizerFileError(f"tokenizer_config.json names special id {self.special_ids['']} with an empty string")
    # Longest first, so that a name containing another is matched whole.
    self._special_re = re.compile("|".join(map(re.escape, sorted(self.special_ids, key=len, reverse=True))))
    self._num_base = num_base
    self._ranks = ranks
    self._text_ids = frozenset(int(i) for i in text_ids)
    text_names = sorted((self._special_names[i] for i in self._text_ids), key=len, reverse=True)
    self._text_re = re.compile("|".join(map(re.escape, text_names))) if text_names else None
    self.encoding = tiktoken.Encoding(name=Path(ranks_path).name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.special_ids)
    self.vocab_size = self.encoding.n_vocab
    self.special_spellings = tuple(name for name, i in self.special_ids.items() if i not in self._text_ids)

  def encode(self, text: str) -> list[int]:
    return self._encode_literal(text) if self._text_re is None else self._encode_around(self._text_re, text)

  def encode_parsing_special(self, text: str) -> list[int]:
    return self._encode_around(self._special_re, text)

  def _encode_around(self, names: re.Pattern, text: str) -> list[int]:
    # The named tokens first, then the text between them in pieces: a cut of the long-run rule
    # must never fall inside a marker (tokenizers split on added tokens first too).
    ids, start = [], 0
    for match in names.finditer(text):
      ids += self._encode_literal(text[start:match.start()])
      ids.append(self.special_ids[match.group()])
      start = match.end()
    return ids + self._encode_literal(text[start:])

  def _encode_literal(self, text: str) -> list[int]:
    return [i for piece in _pieces(text) for i in self.encoding.encode(piece, disallowed_special=())]

  def decode(self, ids: Sequence[int]) -> str:
    # tiktoken decodes bytes with errors="replace": an incomplete UTF-8 tail shows as U+FFFD, which
    # the stream holds back until its last byte arrives, as with tokenizers. Special ids and ids
    # past the tokenizer (a model vocabulary padded beyond it) have no text; reserved ids marked
    # not special decode to their names.
    return self.encoding.decode([i for i in map(int, ids) if 0 <= i < self._num_base or i in self._text_ids])

  decode_long = decode  # tiktoken's decode already releases the GIL

  def token_bytes(self, token_id: int) -> bytes:
    """One token's bytes (a special id's name; b"" past the tokenizer)."""
    token_id = int(token_id)
    if 0 <= token_id < self._num_base:
      return self.encoding.decode_single_token_bytes(token_id)
    return self._special_names.get(token_id, "").encode("utf-8")

  def token_to_id(self, name: str) -> int | None:
    if name in self.special_ids:
      return self.special_ids[name]
    return self._ranks.get(name.encode("utf-8"))


def read_ranks(path) -> dict[bytes, int]:
  """A tiktoken BPE file's ranks (one ``base64(token bytes) rank`` line each), read from the file as
  it is now. (``tiktoken.load.load_tiktoken_bpe`` caches every file it reads, local ones too, under a
  key made from the path alone, in a shared temporary directory: a file replaced at the same path
  would keep its old ranks.)"""
  try:
    lines = Path(path).read_bytes().splitlines()
  except OSError as err:
    raise TokenizerFileError(f"{path}: cannot be read ({err})") from None
  ranks = {}
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      token, rank = line.split()
      ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error) as err:  # binascii.Error is a ValueError too
      raise TokenizerFileError(f"{path}: line {number} is not 'base64(token) rank' ({err})") from None
  return ranks


def _pieces(text: str):
  """``text`` cut as tokenization_kimi.py cuts it before tiktoken (see ``_MAX_CHUNK_CHARS``)."""
  for start in range(0, len(text), _MAX_CHUNK_CHARS):
    chunk = text[start:start + _MAX_CHUNK_CHARS]
    run, run_is_space, piece_start = 0, chunk[:1].isspace(), 0
    for i, char in enumerate(chunk):
      if char.isspace() != run_is_space:
        run, run_is_space = 1, char.isspace()
      else:
        run += 1
        if run > _MAX_RUN_CHARS:
          yield chunk[piece_start:i]
          piece_start, run = i, 1
    yield chunk[piece_start:]


def load(directory) -> HFTokenizer | KimiTiktokenTokenizer:
  """The tokenizer of a checkpoint directory: ``tokenizer.json`` where it has one, else
  ``tiktoken.model`` (special names from ``tokenizer_config.json``)."""
  directory = Path(directory)
  if (directory / "tokenizer.json").exists():
    return HFTokenizer(Tokenizer.from_file(os.fspath(directory / "tokenizer.json")),
                       control_tokens=named_special_tokens(read_tokenizer_config(directory)).values())
  if not (directory / "tiktoken.model").exists():
    raise FileNotFoundError(f"{directory} has neither tokenizer.json nor tiktoken.model (the server needs one "
                            "to read text)")
  _check_kimi_pattern(directory)
  config = read_tokenizer_config(directory)
  decoder = config.get("added_tokens_decoder")
  if not isinstance(decoder, dict) or not decoder:
    # Without it every special id would be <|reserved_token_N|>: no [EOS], no turn markers.
    raise TokenizerFileError(f"{directory / 'tokenizer_config.json'}: a tiktoken.model checkpoint needs "
                             "added_tokens_decoder (the names of its special ids), got "
                             f"{'nothing' if decoder is None else repr(decoder)[:80]}")
  names, text_ids = {}, []
  control = set(CHAT_MARKERS) | set(named_special_tokens(config).values())
  for key, token in decoder.items():
    content = token.get("content") if isinstance(token, dict) else token
    if not (isinstance(key, str) and key.isdigit() and isinstance(content, str)):
      raise TokenizerFileError(f"{directory / 'tokenizer_config.json'}: added_tokens_decoder entry {key!r}: "
                               "expected an id and a {'content': name} dict")
    names[int(key)] = content
    if isinstance(token, dict) and token.get("special", True) is False and content not in control:
      text_ids.append(int(key))  # a turn marker or a named control token stays special whatever it says
  return KimiTiktokenTokenizer(directory / "tiktoken.model", names, text_ids)


def read_tokenizer_config(directory) -> dict:
  path = Path(directory) / "tokenizer_config.json"
  if not path.exists():
    return {}
  try:
    config = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise TokenizerFileError(f"{path}: not valid JSON ({err})") from None
  if not isinstance(config, dict):
    raise TokenizerFileError(f"{path}: expected a JSON object")
  return config


def _check_kimi_pattern(directory: Path) -> None:
  """A ``tokenization_kimi.py`` beside ``tiktoken.model`` must spell the pattern this module uses
  (its code is not run here); a checkpoint without one is taken to use Kimi's."""
  source = directory / "tokenization_kimi.py"
  if source.exists():
    text = source.read_text(errors="replace")
    missing = [piece for piece in KIMI_PATTERN_PIECES if piece not in text]
    if missing:
      raise TokenizerFileError(
          f"{source}: its pre-tokeniser pattern differs from Kimi's that this server uses (no {missing[0]!r}); "
          "convert the tokenizer to tokenizer.json instead")
