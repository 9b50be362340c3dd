"""Text in and out of the server: prompts to token ids, chat templates, streamed detokenisation,
stop strings.

Special tokens enter a prompt only by id: a user's text that spells ``<|im_end|>`` is encoded as
those characters, so a message cannot forge a turn boundary. A checkpoint's own Jinja chat
template (``tokenizer_config.json``'s ``chat_template``) renders to a string whose special-token
spellings *are* meant as ids; only the template's own text is parsed for them, never a message's
(``TextCodec._checkpoint_chat_prompt``).
"""

import dataclasses
import datetime
import json
import secrets
from pathlib import Path
from typing import Sequence

import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer

from models import loading
from models.config import eos_token_ids
from serve import tokenizer_files

# The built-in template (the demo pair's; Kimi's turn format without thinking or tool blocks):
#   [BOS when the tokenizer adds one]
#   <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>   per message, then
#   <|im_assistant|>assistant<|im_middle|>                  to open the reply.
CHAT_ROLES = ("system", "user", "assistant")


class TextError(ValueError):
  """A prompt or message that cannot be encoded; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Message:
  role: str
  content: str


class TextCodec:
  """A model directory's tokenizer and chat template.

  Args:
    tokenizer: a ``tokenizers.Tokenizer``, or a tokenizer of ``serve.tokenizer_files`` (what
      ``from_model_dir`` reads: ``tokenizer.json`` or Kimi's ``tiktoken.model``).
    chat_template: a Jinja template string, or None for the built-in Kimi-style template (which
      needs the ``<|im_*|>`` special tokens in the vocabulary).
    eos_token_id: the model's end-of-sequence id (a default stop id).
    extra_stop_ids: more ids that end every request by default: the rest of a ``config.json``
      ``eos_token_id`` list, ``generation_config.json``'s and ``tokenizer_config.json``'s
      ``eos_token`` (``from_model_dir``).
    bos_token_id: prepended to completion prompts when the model expects it (None: nothing).
  """

  def __init__(self, tokenizer, *, chat_template: str | None, eos_token_id: int,
               bos_token_id: int | None = None, special_tokens: dict | None = None, extra_stop_ids=()):
    self.backend = (tokenizer_files.HFTokenizer(tokenizer, control_tokens=(special_tokens or {}).values())
                    if isinstance(tokenizer, Tokenizer) else tokenizer)
    self.eos_token_id = eos_token_id
    # Every id that ends a request by default (the model's EOS first).
    self.stop_ids = tuple(dict.fromkeys([eos_token_id, *(int(i) for i in extra_stop_ids)]))
    self.bos_token_id = bos_token_id
    self.vocab_size = self.backend.vocab_size
    self._template = None
    if chat_template is not None:
      # The environment Hugging Face's apply_chat_template renders in, so that a checkpoint's
      # template gives the prompt the model was trained on: loop controls, its {% generation %}
      # tag, raise_exception, strftime_now, and a tojson that neither escapes HTML nor sorts keys.
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                         extensions=["jinja2.ext.loopcontrols", _GenerationTag])
      env.globals["raise_exception"] = _raise_template_error
      env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
      env.filters["tojson"] = _tojson
      self._template = env.from_string(chat_template)
    self._special_tokens = dict(special_tokens or {})
    # Spellings the template parser turns into special ids and the literal encoder does not: never
    # from a message's content. (Non-special added tokens are matched by both alike.)
    self._special_spellings = self.backend.special_spellings
    self._marker = {name: self.backend.token_to_id(name) for name in
                    ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")}
    self.chat_stop_ids = tuple(i for i in (self._marker["<|im_end|>"],) if i is not None)

  @classmethod
  def from_model_dir(cls, directory, *, eos_token_id: int, chat: bool = True) -> "TextCodec":
    """Reads the tokenizer (``tokenizer.json``, else Kimi's ``tiktoken.model``) and the chat template
    (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``), if any. With
    ``chat`` a model with neither a template nor the built-in one's markers is refused."""
    directory = Path(directory)
    tok = tokenizer_files.load(directory)
    config = tokenizer_files.read_tokenizer_config(directory)
    template = config.get("chat_template")
    if (directory / "chat_template.jinja").exists():  # where transformers >= 4.43 saves it
      template = (directory / "chat_template.jinja").read_text()
    elif isinstance(template, list):  # HF allows named templates; the default one serves chat
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      if not isinstance(named.get("default"), str):
        raise TextError(f"{directory / 'tokenizer_config.json'}: chat_template lists templates "
                        f"{sorted(map(str, named))} but none named 'default', which chat would use")
      template = named["default"]
    special = tokenizer_files.named_special_tokens(config)  # Hugging Face passes each to the template
    bos = tok.token_to_id(special["bos_token"]) if config.get("add_bos_token") and special.get("bos_token") else None
    # KimiConfig keeps the first of a list of EOS ids; the others, and the tokenizer's own EOS
    # token, end a request too (a turn format whose end marker is not EOS would run on past it).
    # generation_config.json's list is what transformers' generate() and vLLM stop at (for Kimi K2
    # the end of a turn, where config.json names [EOS]).
    extra = []
    for name in ("config.json", "generation_config.json"):
      if (directory / name).exists():
        extra += [i for i in eos_token_ids(loading.read_json(directory / name)) if 0 <= i < tok.vocab_size]
    if special.get("eos_token") and tok.token_to_id(special["eos_token"]) is not None:
      extra.append(tok.token_to_id(special["eos_token"]))
    codec = cls(tok, chat_template=template, eos_token_id=eos_token_id, bos_token_id=bos, special_tokens=special,
                extra_stop_ids=extra)
    if chat and template is None and any(i is None for i in codec._marker.values()):
      raise TextError(f"{directory}: no chat template (chat_template.jinja or tokenizer_config.json) and no "
                      "<|im_*|> tokens for the built-in one")
    return codec

  @property
  def template_name(self) -> str:
    return "checkpoint's" if self._template is not None else "built-in Kimi-style"

  # ---- prompts -----------------------------------------------------------------------------
  def encode(self, text: str) -> list[int]:
    """Token ids of ``text`` read literally (no special token parsed)."""
    return self.backend.encode(text)

  def token_to_id(self, name: str) -> int | None:
    return self.backend.token_to_id(name)

  def completion_prompt(self, prompt) -> list[int]:
    """A completion's prompt (a string, or token ids) as token ids."""
    if isinstance(prompt, str):
      ids = self.encode(prompt)
      if self.bos_token_id is not None:
        ids = [self.bos_token_id] + ids
    else:
      ids = [int(t) for t in prompt]
      bad = [t for t in ids if not 0 <= t < self.vocab_size]
      if bad:
        raise TextError(f"prompt: token id {bad[0]} outside [0, {self.vocab_size})")
    if not ids:
      raise TextError("prompt: empty (it must hold at least one token)")
    return ids

  def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
    """The prompt of a chat: every message in the template, then the assistant's turn opened."""
    if not messages:
      raise TextError("messages: empty (at least one message is needed)")
    # Checked for a checkpoint's template too: it renders the role as text and parses the result
    # for special tokens, so a free role could spell turn markers that its content may not.
    for i, message in enumerate(messages):
      if message.role not in CHAT_ROLES:
        raise TextError(f"messages[{i}].role: {message.role!r} is not one of {list(CHAT_ROLES)}")
    if self._template is not None:
      return self._checkpoint_chat_prompt(messages)
    if any(i is None for i in self._marker.values()):  # a codec read with chat=False
      raise TextError("messages: this model has no chat template and no <|im_*|> tokens for the built-in one")
    ids: list[int] = []
    for message in messages:
      ids += [self._marker[f"<|im_{message.role}|>"], *self.encode(message.role), self._marker["<|im_middle|>"],
              *self.encode(message.content), self._marker["<|im_end|>"]]
    ids += [self._marker["<|im_assistant|>"], *self.encode("assistant"), self._marker["<|im_middle|>"]]
    return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids

  def _checkpoint_chat_prompt(self, messages: Sequence[Message]) -> list[int]:
    """The checkpoint template's prompt. The template's own special-token spellings become ids
    (the rendered text is parsed for them); a message's content never does, so a user cannot forge
    a turn marker. Where no content holds a special token's spelling the whole rendering is parsed
    at once (token boundaries as the model was trained with). Otherwise the template is rendered
    with a placeholder per content, its pieces parsed and each content encoded literally between
    them; a template that does not insert contents verbatim cannot be split so, and is refused."""
    render = lambda contents: self._template.render(
        messages=[dict(dataclasses.asdict(m), content=c) for m, c in zip(messages, contents)],
        add_generation_prompt=True, tools=None, documents=None, **self._special_tokens)
    contents = [m.content for m in messages]
    if not any(word in c for c in contents for word in self._special_spellings):
      return self.backend.encode_parsing_special(render(contents))
    refused = TextError("messages: a message holds a special token's text, and the chat template does not insert "
                        "each message's content once and verbatim, so it cannot be kept literal")
    marks = [f"\x00{secrets.token_hex(8)}\x00" for _ in contents]
    text = render(marks)
    pieces, ids = [], []
    for mark, content in zip(marks, contents):
      before, found, text = text.partition(mark)
      if not found or mark in text:
        raise refused
      ids += self.backend.encode_parsing_special(before) + self.encode(content)
      pieces.append(before)
    ids += self.backend.encode_parsing_special(text)
    if "".join(p + c for p, c in zip(pieces, contents)) + text != render(contents):
      raise refused
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text of ``ids``, special tokens left out."""
    return self.backend.decode(ids)

  def token_bytes(self, token_id: int) -> bytes:
    """One token's bytes, special tokens spelled out (what a log-probability entry shows)."""
    return self.backend.token_bytes(token_id)

  def decode_long(self, ids: Sequence[int]) -> str:
    """``decode`` for a whole prompt, releasing the GIL while it runs (tokenizers' ``decode`` holds
    it, ~75 ms for a megabyte's ids); a stream's small windows keep ``decode``."""
    return self.backend.decode_long(ids)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}`` (marks the assistant's text for training masks in
  Hugging Face's renderer): here it renders its body unchanged."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _raise_template_error(message):
  raise TextError(f"chat template: {message}")


class StreamText:
  """Turns a growing list of token ids into text deltas, holding back what is not final yet.

  Held back: an incomplete UTF-8 sequence (the decoder shows it as U+FFFD until its last byte
  arrives) and any tail that could be the start of a stop string. A stop string ends the text
  before it (OpenAI's behaviour: the stop string itself is not returned).
  """

  def __init__(self, codec: TextCodec, stop_strings: Sequence[str] = ()):
    self.codec = codec
    self.stop_strings = tuple(s for s in stop_strings if s)
    self.text = ""  # decoded text of every token so far (before any stop-string cut)
    self.sent = 0  # characters of ``text`` handed out
    self.stopped = False
    self.stop_match: tuple[int, str] | None = None  # (index in ``text``, stop string) once found
    self._prefix = 0  # tokens before the decode window; decoding in windows keeps each step O(new)
    self._read = 0
    # The held-back tail is tracked by one prefix automaton per stop string (Knuth-Morris-Pratt),
    # fed only the characters added since the last step, so a step costs O(new text) whatever the
    # stop strings' lengths (re-testing every prefix each step cost up to 8 ms a request with 16
    # strings of 1000 characters, on the engine thread every request's step waits for).
    self._failure = [_prefix_function(s) for s in self.stop_strings]
    self._matched = [0] * len(self.stop_strings)  # per stop string: its longest prefix ending the text
    self._scanned = 0  # characters of ``text`` the automata have read

  def push(self, ids: Sequence[int], final: bool = False) -> str:
    """Reads ``ids`` (all tokens so far); returns the new text that is safe to send."""
    if self.stopped:
      return ""
    window = self.codec.decode(ids[self._prefix:])
    if len(ids) > self._read and (final or not window.endswith("\ufffd")):
      before = self.codec.decode(ids[self._prefix:self._read])
      self.text += window[len(before):]
      self._prefix, self._read = self._read, len(ids)
    match = self._find_stop(ids)
    if match is not None:
      self.stopped, self.stop_match = True, match
      return self._take(match[0])
    if final:
      return self._take(len(self.text))
    return self._take(len(self.text) - self._held_back())

  def _find_stop(self, ids: Sequence[int]) -> tuple[int, str] | None:
    """The stop string that a stream of one token a step would meet: (index in the text, string),
    or None. Of the stop strings in the text, the one completed by the fewest tokens of ``ids``;
    of those, the earliest. (The earliest alone is not enough: a step of several tokens can hold
    a long stop string that starts first and a short one inside it that was complete tokens
    earlier, and what a client sees must not depend on how many tokens a step accepted.)"""
    # A stop string may straddle earlier text: search from where the longest could start.
    start = max(0, self.sent - max((len(s) for s in self.stop_strings), default=0))
    hits = sorted((i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop_strings) if i >= 0)
    if len(hits) > 1:
      return min(hits, key=lambda hit: self.tokens_through(ids, *hit))  # stable: the earliest among ties
    return hits[0] if hits else None

  def tokens_through(self, ids: Sequence[int], start: int, stop: str) -> int:
    """The fewest leading tokens of ``ids`` whose text holds ``stop`` at ``start``."""
    lo, hi = 1, len(ids)  # decode(ids[:n]) holds it for every n >= the answer
    while lo < hi:
      mid = (lo + hi) // 2
      if self.codec.decode(ids[:mid])[start:start + len(stop)] == stop:
        hi = mid
      else:
        lo = mid + 1
    return lo

  def _held_back(self) -> int:
    """Length of the longest tail of the text that is a proper prefix of a stop string."""
    new = self.text[self._scanned:]
    self._scanned = len(self.text)
    best = 0
    for i, (stop, failure) in enumerate(zip(self.stop_strings, self._failure)):
      matched = self._matched[i]
      for char in new:
        while matched and (matched == len(stop) or stop[matched] != char):
          matched = failure[matched - 1]
        if stop[matched] == char:
          matched += 1
      self._matched[i] = matched
      # A whole match has stopped the stream before this is asked; its proper part is the fallback.
      best = max(best, matched if matched < len(stop) else failure[matched - 1])
    return best

  def _take(self, end: int) -> str:
    end = max(end, self.sent)
    out, self.sent = self.text[self.sent:end], end
    return out


def _prefix_function(pattern: str) -> list[int]:
  """``out[i]``: the length of the longest proper prefix of ``pattern[:i + 1]`` that is also its suffix."""
  out = [0] * len(pattern)
  for i in range(1, len(pattern)):
    k = out[i - 1]
    while k and pattern[i] != pattern[k]:
      k = out[k - 1]
    out[i] = k + (pattern[i] == pattern[k])
  return out
