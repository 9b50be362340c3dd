"""OpenAI request bodies, their checks, and error bodies.

Every field a client can send is listed. A field this server cannot honour (penalties, logit
bias, tools, ``n`` > 1) is refused with 400 when set to anything
but its neutral value, and an unknown field is refused too: a client's intent is never silently
dropped. Types are strict (``"max_tokens": "5"`` or ``"stream": "yes"`` are 400s, not coerced);
an int is accepted where a float is expected.
"""

from typing import Annotated, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

MAX_TEMPERATURE = 1000.0
MAX_STOP_STRING_CHARS = 1000
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs; the server's --max-logprobs may be lower


class ApiError(Exception):
  """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

  def __init__(self, status: int, message: str, *, param: str | None = None, type_: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.param = param
    self.type = type_ or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                          503: "service_unavailable"}.get(
                              status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    self.code = code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  include_usage: bool | None = False  # null means false, as for the other optional flags


class _Sampling(BaseModel):
  """Fields shared by completions and chat completions."""

  model_config = ConfigDict(extra="forbid", strict=True)

  model: str | None = None
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  n: int | None = None
  seed: int | None = None
  stream: bool | None = False  # null (as OpenAI's clients may send for unset fields): false
  stream_options: StreamOptions | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool | None = False
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  repetition_penalty: float | None = None
  logit_bias: dict[str, float] | None = None
  return_token_ids: bool | None = False
  user: str | None = None
  metadata: dict | None = None
  store: bool | None = None
  service_tier: str | None = None

  def check(self, max_stop_strings: int = 16) -> None:
    """Refuses values this server cannot honour (raises ApiError 400 naming the field)."""
    if self.temperature is not None and not 0 <= self.temperature <= MAX_TEMPERATURE:
      # The bound keeps (logit - max) / T a normal float32 (1e39 became inf, silently dropping top_k).
      raise ApiError(400, f"temperature must lie in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
                     param="temperature")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ApiError(400, f"top_p must lie in (0, 1], got {self.top_p}", param="top_p")
    if self.top_k is not None and not -1 <= self.top_k < 2**31:
      raise ApiError(400, f"top_k must be -1 or 0 (off) or a positive int32, got {self.top_k}", param="top_k")
    if self.n not in (None, 1):
      raise ApiError(400, f"n={self.n} is not supported: this server returns one choice per request", param="n")
    if self.seed is not None and not -2**63 <= self.seed < 2**63:  # OpenAI's range: any int64
      raise ApiError(400, f"seed must be a 64-bit integer, got {self.seed}", param="seed")
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(self, name) not in (None, 0):
        raise ApiError(400, f"{name} is not supported (penalties would change the target's distribution per "
                       "tree node; this server does not apply them)", param=name)
    if self.repetition_penalty not in (None, 1):
      raise ApiError(400, "repetition_penalty is not supported (only 1.0)", param="repetition_penalty")
    if self.logit_bias:
      raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if self.stream_options is not None and not self.stream:
      raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    stops = self.stop_strings
    if len(stops) > max_stop_strings:
      raise ApiError(400, f"stop: at most {max_stop_strings} stop strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
      raise ApiError(400, "stop: stop strings must not be empty", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
      # Matching a stop string's prefixes against each new tail costs the engine thread O(len^2).
      raise ApiError(400, f"stop: stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got "
                     f"{max(len(s) for s in stops)}", param="stop")

  @property
  def stop_strings(self) -> list[str]:
    if self.stop is None:
      return []
    return [self.stop] if isinstance(self.stop, str) else list(self.stop)

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)

  @property
  def top_logprobs_wanted(self) -> int | None:
    """None: no log-probabilities asked for; n: each token's and its n most likely alternatives'."""
    return None


def _check_top_logprobs(name: str, value: int | None) -> None:
  if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
    raise ApiError(400, f"{name} must lie in [0, {MAX_TOP_LOGPROBS}], got {value}", param=name)


class CompletionRequest(_Sampling):
  prompt: str | list[int] | list[str] | list[list[int]]
  max_tokens: int | None = 16
  echo: bool | None = False
  logprobs: int | None = None
  best_of: int | None = None
  suffix: str | None = None

  def check(self, max_stop_strings: int = 16) -> None:
    super().check(max_stop_strings)
    _check_top_logprobs("logprobs", self.logprobs)
    if self.best_of not in (None, 1):
      raise ApiError(400, f"best_of={self.best_of} is not supported (only 1)", param="best_of")
    if self.suffix is not None:
      raise ApiError(400, "suffix is not supported", param="suffix")
    if self.max_tokens is not None and self.max_tokens <= 0:
      raise ApiError(400, f"max_tokens must be positive, got {self.max_tokens}", param="max_tokens")

  @property
  def top_logprobs_wanted(self) -> int | None:
    return self.logprobs

  @property
  def single_prompt(self):
    """The one prompt (a string or a token-id list); a batch of several is refused."""
    prompt = self.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
      if len(prompt) != 1:
        raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is not supported; send one per request",
                       param="prompt")
      prompt = prompt[0]
    if isinstance(prompt, list) and not prompt:
      raise ApiError(400, "prompt: empty", param="prompt")
    return prompt


class TextPart(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  type: Literal["text"]
  text: str


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  role: str
  content: str | list[TextPart] | None = None
  name: str | None = None

  @property
  def text(self) -> str:
    if self.content is None:
      return ""
    if isinstance(self.content, str):
      return self.content
    return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
  messages: Annotated[list[ChatMessage], Field(min_length=1)]
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = None
  tools: list | None = None
  tool_choice: str | dict | None = None
  response_format: dict | None = None

  def check(self, max_stop_strings: int = 16) -> None:
    super().check(max_stop_strings)
    _check_top_logprobs("top_logprobs", self.top_logprobs)
    if self.top_logprobs is not None and not self.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if self.tools:
      raise ApiError(400, "tools are not supported by this server", param="tools")
    if self.tool_choice not in (None, "none"):
      raise ApiError(400, "tool_choice is not supported by this server", param="tool_choice")
    if self.response_format not in (None, {"type": "text"}):
      raise ApiError(400, "response_format is not supported (only text)", param="response_format")
    for name in ("max_tokens", "max_completion_tokens"):
      value = getattr(self, name)
      if value is not None and value <= 0:
        raise ApiError(400, f"{name} must be positive, got {value}", param=name)
    for i, message in enumerate(self.messages):
      if message.name is not None:  # no chat template here receives it: refused rather than dropped
        raise ApiError(400, "messages[].name is not supported by this server", param=f"messages.{i}.name")

  @property
  def top_logprobs_wanted(self) -> int | None:
    return (self.top_logprobs or 0) if self.logprobs else None

  @property
  def token_limit(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def validation_error(err: pydantic.ValidationError | list) -> ApiError:
  """The first problem of a body that did not parse, as a 400 naming the field."""
  errors = err.errors() if isinstance(err, pydantic.ValidationError) else list(err)
  if not errors:
    return ApiError(400, "invalid request body")
  first = errors[0]
  loc = [str(p) for p in first.get("loc", ()) if p != "body"]
  # Union types report one error per member; the field path is what the client needs.
  field = ".".join(p for p in loc if not _is_type_tag(p)) or None
  kind = first.get("type", "")
  if kind == "json_invalid":
    return ApiError(400, f"malformed JSON body: {first.get('msg', '')}", param=None)
  if kind == "missing":
    return ApiError(400, f"missing required field '{field}'", param=field)
  if kind == "extra_forbidden":
    return ApiError(400, f"unsupported field '{field}'", param=field)
  if kind in ("model_type", "dict_type") and not field:
    return ApiError(400, "the request body must be a JSON object", param=None)
  return ApiError(400, f"invalid value for '{field}': {first.get('msg', 'wrong type')}", param=field)


def _is_type_tag(part: str) -> bool:
  # pydantic names union members in locations, e.g. 'str', 'list[int]', 'function-after[...]'.
  return part in ("str", "int", "float", "bool", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]",
                  "dict[str,float]") or "[" in part and part.split("[")[0] in ("list", "dict", "function-after")
