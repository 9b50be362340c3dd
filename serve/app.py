"""The HTTP side: OpenAI-compatible routes over an ``EngineLoop``.

Handlers validate, build a job, and wait for its events; the engine thread does all device work.
A request whose client disconnects is cancelled (its cache slot is freed on the engine's next turn).
"""

import asyncio
import codecs
import json
import math
import logging
import secrets
import threading
import time
import uuid
from typing import Any, AsyncIterator

import jinja2
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from serve import protocol
from serve.config import Engine
from serve.engine_loop import Event, Job, QueueFull
from serve.protocol import ApiError
from serve.text import Message, StreamText, TextError

log = logging.getLogger("ddtree_jax.serve")

_ENGINE_CHECK_S = 1.0  # how often a waiting handler checks that the engine thread is alive


class ServerState:
  """What the routes share: the engine once warm-up has finished (None before), or its error."""

  def __init__(self, *, api_key: str | None = None, max_body_bytes: int = 1 << 20):
    self.engine: Engine | None = None
    self.load_error: str | None = None
    self.api_key = api_key
    self.max_body_bytes = max_body_bytes
    self.ready = threading.Event()
    self.started = time.time()

  def set_engine(self, engine: Engine) -> None:
    self.engine = engine
    self.ready.set()

  def require_engine(self) -> Engine:
    if self.load_error:
      raise ApiError(503, f"the model failed to load: {self.load_error}")
    if self.engine is None:
      raise ApiError(503, "the server is still warming up (compiling); retry when /health is ok")
    if not self.engine.loop.alive:
      raise ApiError(503, "the engine thread has stopped")
    return self.engine


def create_app(state: ServerState) -> FastAPI:
  app = FastAPI(title="ddtree-jax", description="OpenAI-compatible server with DDTree speculative decoding")

  @app.exception_handler(ApiError)
  async def _api_error(_request: Request, err: ApiError):
    return JSONResponse(err.body(), status_code=err.status)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request: Request, err: StarletteHTTPException):  # unknown route, wrong method
    message = f"{request.method} {request.url.path}: {err.detail}"
    return JSONResponse(ApiError(err.status_code, message).body(), status_code=err.status_code,
                        headers=getattr(err, "headers", None))

  @app.exception_handler(Exception)
  async def _unexpected(_request: Request, err: Exception):
    log.exception("unexpected error in a request handler")
    return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}: {err}").body(), status_code=500)

  app.add_middleware(_Guard, state=state)

  @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers often probe with HEAD
  async def health():
    if state.load_error:
      return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
    if state.engine is None:
      return JSONResponse({"status": "loading"}, status_code=503)
    if not state.engine.loop.alive:
      return JSONResponse({"status": "error", "error": "engine thread stopped"}, status_code=503)
    return {"status": "ok", "model": state.engine.config.model_name, **state.engine.loop.snapshot()}

  @app.get("/metrics")
  async def metrics():
    if state.engine is None:
      return Response(b"", media_type="text/plain; version=0.0.4")
    return Response(state.engine.metrics.render(), media_type="text/plain; version=0.0.4")

  def model_card(eng: Engine) -> dict:
    return {"id": eng.config.model_name, "object": "model", "created": int(state.started), "owned_by": "ddtree-jax",
            "max_model_len": eng.max_context, "spec": eng.config.spec}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card(state.require_engine())]}

  @app.get("/v1/models/{model_id:path}")
  async def model(model_id: str):
    eng = state.require_engine()
    _check_model(eng, model_id)
    return model_card(eng)

  @app.post("/v1/completions")
  async def completions(request: Request):
    eng, body = await _accept(state, request, protocol.CompletionRequest)
    try:  # a megabyte of text takes a while to tokenize: not on the event loop, which serves every client
      prompt_ids = await run_in_threadpool(eng.codec.completion_prompt, body.single_prompt)
    except TextError as err:
      raise ApiError(400, str(err), param="prompt") from None
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    prefix = ""
    if body.echo:
      prefix = (body.single_prompt if isinstance(body.single_prompt, str)
                else await run_in_threadpool(eng.codec.decode_long, prompt_ids))
    return await _serve(request, eng, body, prompt_ids, max_tokens, chat=False, echo=prefix)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    eng, body = await _accept(state, request, protocol.ChatCompletionRequest)
    try:
      prompt_ids = await run_in_threadpool(eng.codec.chat_prompt, [Message(m.role, m.text) for m in body.messages])
    except TextError as err:
      raise ApiError(400, str(err), param="messages") from None
    except jinja2.TemplateError as err:  # the checkpoint's template itself failed
      raise ApiError(500, f"the chat template failed: {type(err).__name__}: {err}") from None
    max_tokens = body.token_limit
    if max_tokens is None:
      max_tokens = eng.max_context - len(prompt_ids)
      if max_tokens <= 0:
        raise ApiError(400, f"the messages take {len(prompt_ids)} tokens, which leaves no room in the "
                       f"{eng.max_context}-token context", param="messages", code="context_length_exceeded")
    return await _serve(request, eng, body, prompt_ids, max_tokens, chat=True)

  return app


class _Guard:
  """API key, body size limit and the request counter, before any route runs.

  A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware``
  relays ``receive`` through a task, and routes behind it never see ``http.disconnect``, so an
  abandoned non-streaming request could not be cancelled.
  """

  def __init__(self, app, state: ServerState):
    self.app = app
    self.state = state

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    state, path = self.state, scope["path"]
    status = {}

    async def send_counted(message):
      if message["type"] == "http.response.start":
        status["code"] = message["status"]
      await send(message)

    try:
      headers = Headers(scope=scope)
      if state.api_key is not None and path.startswith("/v1/"):
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # The scheme is case-insensitive (RFC 7235); the key is not.
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
          raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                         code="invalid_api_key")
      length = headers.get("content-length")
      if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
        raise ApiError(413, f"request body of {int(length)} bytes exceeds the limit of {state.max_body_bytes}")
    except ApiError as err:
      await JSONResponse(err.body(), status_code=err.status)(scope, receive, send_counted)
    else:
      try:
        await self.app(scope, receive, send_counted)
      except Exception:
        # Starlette's outermost middleware answers it (the handler for Exception: a 500), outside
        # this one, so its response never passes through ``send_counted``.
        status.setdefault("code", 500)
        raise
    finally:
      if state.engine is not None and path.startswith("/v1/") and "code" in status:
        # Unknown paths share one label: clients must not be able to mint new series.
        endpoint = path if path in _ROUTES else "other"
        state.engine.metrics.requests.labels(endpoint, str(status["code"])).inc()


_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def _reject_constant(name: str):
  raise ValueError(f"{name} is not a valid JSON number")


def protocol_parse(model, obj):
  try:
    return model.model_validate(obj)
  except pydantic.ValidationError as err:
    raise protocol.validation_error(err) from None


async def _read_json(request: Request, limit: int) -> Any:
  """The body as JSON, read up to ``limit`` bytes (413 beyond, also without a Content-Length)."""
  chunks, size = [], 0
  try:
    async for chunk in request.stream():
      size += len(chunk)
      if size > limit:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
      chunks.append(chunk)
  except ClientDisconnect:  # nobody reads the answer; counted as 499, as a client gone mid-request
    raise ApiError(499, "the client closed the connection before sending its whole body") from None
  raw = b"".join(chunks)
  try:
    obj = json.loads(raw, parse_constant=_reject_constant)
  except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise ApiError(400, f"malformed JSON body: {err}") from None
  if not isinstance(obj, dict):
    raise ApiError(400, "the request body must be a JSON object")
  try:  # JSON may escape a lone UTF-16 surrogate ("\ud800"), which is no text: refuse it here, once
    json.dumps(obj, ensure_ascii=False).encode("utf-8")
  except UnicodeEncodeError as err:
    raise ApiError(400, f"malformed JSON body: a string holds a lone UTF-16 surrogate ({err.reason})") from None
  except RecursionError:
    raise ApiError(400, "malformed JSON body: nested too deeply") from None
  return obj


async def _accept(state: ServerState, request: Request, body_type):
  """The engine and the request's checked body (raises ApiError: 503, 400, 413 or 404)."""
  eng = state.require_engine()
  body = protocol_parse(body_type, await _read_json(request, state.max_body_bytes))
  body.check()
  _check_model(eng, body.model)
  return eng, body


def _check_model(eng: Engine, model: str | None) -> None:
  if model is not None and model != eng.config.model_name:
    raise ApiError(404, f"the model '{model}' does not exist; this server serves '{eng.config.model_name}'",
                   param="model", code="model_not_found")


def _stop_ids(eng: Engine, body, chat: bool) -> list[int]:
  ids = [] if body.ignore_eos else list(eng.codec.stop_ids)
  if chat and not body.ignore_eos:
    ids += list(eng.codec.chat_stop_ids)
  for t in body.stop_token_ids or []:
    if not 0 <= t < eng.codec.vocab_size:
      raise ApiError(400, f"stop_token_ids: {t} is outside [0, {eng.codec.vocab_size})", param="stop_token_ids")
    ids.append(t)
  ids = list(dict.fromkeys(ids))
  limit = eng.loop.decoder.max_stop_tokens
  if len(ids) > limit:
    raise ApiError(400, f"stop_token_ids: {len(ids)} stop ids (the model's own included) exceed this server's "
                   f"limit of {limit}", param="stop_token_ids")
  return ids


def _check_logprobs(eng: Engine, body, chat: bool) -> None:
  """A request for more log-probabilities than the server computes is refused (400), never cut."""
  wanted = body.top_logprobs_wanted
  if wanted is None:
    return
  param = "top_logprobs" if chat else "logprobs"
  limit = eng.loop.decoder.logprobs
  if limit is None:
    raise ApiError(400, "log-probabilities are off on this server (it was started with --max-logprobs -1)",
                   param="logprobs")
  if wanted > limit:
    raise ApiError(400, f"{param}={wanted} exceeds this server's --max-logprobs {limit}", param=param)


def _echoes_logprobs(body, chat: bool) -> bool:
  """Completions with ``echo`` and ``logprobs`` return the prompt's log-probabilities too."""
  return not chat and bool(body.echo) and body.top_logprobs_wanted is not None


def _make_job(eng: Engine, body, prompt_ids: list[int], max_tokens: int, chat: bool, sink) -> Job:
  _check_logprobs(eng, body, chat)
  context = eng.max_context
  if len(prompt_ids) + max_tokens > context:
    raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                   f"{len(prompt_ids)} tokens and max_tokens is {max_tokens} ({len(prompt_ids) + max_tokens} "
                   "in all)", param="max_tokens" if len(prompt_ids) < context else "prompt",
                   code="context_length_exceeded")
  temperature = 1.0 if body.temperature is None else body.temperature
  # Draws are keyed by 32 bits: a 64-bit seed (negative ones too) is taken modulo 2**32.
  seed = body.seed % 2**32 if body.seed is not None else secrets.randbits(32)
  top_k = body.top_k if body.top_k and body.top_k > 0 else 0
  try:
    request = eng.loop.decoder.request(prompt_ids, max_tokens, temperature=temperature, top_k=top_k,
                                       top_p=1.0 if body.top_p is None else body.top_p, seed=seed,
                                       stop_token_ids=_stop_ids(eng, body, chat),
                                       logprobs=body.top_logprobs_wanted is not None,
                                       prompt_logprobs=_echoes_logprobs(body, chat))
  except ValueError as err:  # EngineError and SamplingParams' checks name the argument
    raise ApiError(400, str(err)) from None
  return Job(request=request, text=StreamText(eng.codec, body.stop_strings), sink=sink,
             textless_stop_ids=frozenset(eng.codec.stop_ids) | frozenset(eng.codec.chat_stop_ids))


async def _serve(request: Request, eng: Engine, body, prompt_ids, max_tokens, *, chat: bool, echo: str = ""):
  loop = asyncio.get_running_loop()
  events: asyncio.Queue[Event] = asyncio.Queue()

  def sink(event: Event) -> None:  # runs on the engine thread
    try:
      loop.call_soon_threadsafe(events.put_nowait, event)
    except RuntimeError:  # the HTTP event loop has closed (shutdown); nobody is listening
      pass

  job = _make_job(eng, body, prompt_ids, max_tokens, chat, sink)
  try:
    eng.loop.submit(job)
  except QueueFull as err:
    raise ApiError(429, str(err)) from None
  reply = _Reply(eng, body, prompt_ids, chat)
  watcher = asyncio.create_task(_watch_disconnect(request, events))
  try:
    first = await _next_event(events, eng)
    if first.error:
      raise ApiError(500, first.error)
    if not body.stream:
      parts, event = [echo, first.text], first
      while event.finish_reason is None:
        event = await _next_event(events, eng)
        if event.error:
          raise ApiError(500, event.error)
        parts.append(event.text)
      return reply.full("".join(parts), event)
  except _ClientGone:
    eng.loop.cancel(job)
    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
  except BaseException:
    eng.loop.cancel(job)  # a no-op for a job that has ended
    raise
  finally:
    watcher.cancel()
  # From here on StreamingResponse notices a disconnect (a failed send) and closes the generator.
  return StreamingResponse(_stream(events, eng, job, reply, first, echo), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _ClientGone(Exception):
  pass


_GONE = Event(error="the client disconnected")


async def _watch_disconnect(request: Request, events: asyncio.Queue) -> None:
  """Puts ``_GONE`` in the job's queue when the client disconnects (the body is already read, so
  the next ASGI message can only be ``http.disconnect``)."""
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      events.put_nowait(_GONE)
      return


async def _next_event(events: asyncio.Queue, eng: Engine) -> Event:
  """The job's next event (raises _ClientGone once the client has disconnected)."""
  while True:
    try:
      event = await asyncio.wait_for(events.get(), _ENGINE_CHECK_S)
    except asyncio.TimeoutError:
      if not eng.loop.alive:
        raise ApiError(503, "the engine thread has stopped") from None
      continue
    if event is _GONE:
      raise _ClientGone()
    return event


async def _stream(events, eng: Engine, job: Job, reply: "_Reply", first: Event, echo: str) -> AsyncIterator[str]:
  finished = False
  try:
    yield _sse(reply.chunk(echo, None, role=True, event=first))
    event = first
    while True:
      if event.error:
        yield _sse(ApiError(500, event.error).body())
        finished = True
        break
      if event.text or event.finish_reason:
        yield _sse(reply.chunk(event.text, event.finish_reason, event=event))
      if event.finish_reason is not None:
        finished = True
        if reply.body.include_usage:
          yield _sse(reply.usage_chunk(event))
        break
      event = await _next_event(events, eng)
    yield "data: [DONE]\n\n"
  except _ClientGone:
    pass
  except ApiError as err:  # the engine thread stopped mid-stream
    yield _sse(err.body())
    yield "data: [DONE]\n\n"
  finally:
    if not finished:  # the client went away (or the server is stopping): free the slot now
      eng.loop.cancel(job)


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Reply:
  """OpenAI response bodies for one request."""

  def __init__(self, eng: Engine, body, prompt_ids, chat: bool):
    self.body = body
    self.chat = chat
    self.model = eng.config.model_name
    self.prompt_tokens = len(prompt_ids)
    self.created = int(time.time())
    self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    self._sent_token_ids = 0
    wanted = body.top_logprobs_wanted
    self._logprobs = None if wanted is None else _Logprobs(eng.codec, chat, wanted)
    self.prompt_ids = list(prompt_ids)
    self._echo_logprobs = _echoes_logprobs(body, chat)

  def usage(self, event: Event) -> dict:
    return {"prompt_tokens": self.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": self.prompt_tokens + event.completion_tokens}

  def full(self, text: str, last: Event) -> dict:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
    if self._logprobs is not None:
      prompt = self._logprobs.prompt_block(self.prompt_ids, last.prompt_logprobs) if self._echo_logprobs else None
      generated = self._logprobs.block(last.tokens, last.token_logprobs(), 0)
      choice["logprobs"] = generated if prompt is None else {k: prompt[k] + generated[k] for k in generated}
    if self.chat:
      choice["message"] = {"role": "assistant", "content": text}
    else:
      choice["text"] = text
    if self.body.return_token_ids:
      choice["token_ids"] = last.token_ids()
    return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(last)}

  def chunk(self, text: str, finish_reason: str | None, *, role: bool = False, event: Event | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if self.chat:
      choice["delta"] = ({"role": "assistant", "content": text} if role else
                         ({"content": text} if text else {}))
    else:
      choice["text"] = text
    if role and event is not None and self._echo_logprobs:  # the echoed prompt's chunk: its entries
      choice["logprobs"] = self._logprobs.prompt_block(self.prompt_ids, event.prompt_logprobs)
    elif event is not None and not role and self._logprobs is not None and event.completion_tokens > self._logprobs.sent:
      start = self._logprobs.sent
      choice["logprobs"] = self._logprobs.block(event.tokens, event.token_logprobs(start), start)
    if self.body.return_token_ids and event is not None and event.completion_tokens and not role:
      choice["token_ids"] = event.token_ids(self._sent_token_ids)
      self._sent_token_ids = event.completion_tokens
    out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
           "created": self.created, "model": self.model, "choices": [choice]}
    if self.body.include_usage:
      out["usage"] = None
    return out

  def usage_chunk(self, last: Event) -> dict:
    return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [], "usage": self.usage(last)}


# What a log-probability that is not a finite float (a logit of -inf) is reported as: JSON has no
# -Infinity, and OpenAI's clients parse floats.
_NO_LOGPROB = -9999.0


class _Logprobs:
  """One request's ``logprobs`` blocks, in the chat format (``content``: token, logprob, bytes,
  top_logprobs) or the completions format (tokens, token_logprobs, top_logprobs, text_offset).

  A token that is part of a character (byte-level BPE) is shown as ``bytes:\\xNN...``, as OpenAI
  does, with its exact bytes; blocks of a stream follow one another (``sent``, the text offset).
  """

  def __init__(self, codec, chat: bool, top_n: int):
    self.codec = codec
    self.chat = chat
    self.top_n = top_n
    self.sent = 0  # tokens whose entries have been sent
    self._offset = 0  # characters of text before the next token (completions' text_offset)
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def block(self, tokens, entries, start: int) -> dict:
    """The block of ``entries`` (TokenLogprobs of ``tokens[start:]``)."""
    ids = tokens[start:start + len(entries)]
    self.sent = start + len(entries)
    if self.chat:
      return {"content": [self._chat_entry(t, e) for t, e in zip(ids, entries)], "refusal": None}
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(ids, entries):
      token = self._token(token_id)
      out["tokens"].append(token)
      out["token_logprobs"].append(_finite(entry.logprob))
      out["top_logprobs"].append(self._top(token, entry))
      out["text_offset"].append(self._offset)
      self._advance(token_id)
    return out

  def prompt_block(self, prompt_ids, entries) -> dict:
    """The completions-format block of an echoed prompt: its first token has no log-probability
    (null, as OpenAI gives it), each later one the entry of ``entries`` (one a token after the first)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, token_id in enumerate(prompt_ids):
      entry = entries[i - 1] if 0 < i <= len(entries) else None  # null where none was computed
      token = self._token(token_id)
      out["tokens"].append(token)
      out["token_logprobs"].append(None if entry is None else _finite(entry.logprob))
      out["top_logprobs"].append(None if entry is None else self._top(token, entry))
      out["text_offset"].append(self._offset)
      self._advance(token_id)
    return out

  def _top(self, token: str, entry) -> dict:
    # The legacy format always includes the chosen token: up to logprobs + 1 entries.
    top = {self._token(i): _finite(lp) for i, lp in entry.top[:self.top_n]}
    top.setdefault(token, _finite(entry.logprob))
    return top

  def _advance(self, token_id) -> None:
    if self.codec.decode([token_id]):  # special tokens have no text: they move no offset
      self._offset += len(self._utf8.decode(self.codec.token_bytes(token_id)))

  def _chat_entry(self, token_id, entry) -> dict:
    return {**self._described(token_id, entry.logprob),
            "top_logprobs": [self._described(i, lp) for i, lp in entry.top[:self.top_n]]}

  def _described(self, token_id, logprob) -> dict:
    raw = self.codec.token_bytes(token_id)
    return {"token": _token_string(raw), "logprob": _finite(logprob), "bytes": list(raw)}

  def _token(self, token_id) -> str:
    return _token_string(self.codec.token_bytes(token_id))


def _token_string(raw: bytes) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _finite(logprob: float) -> float:
  return logprob if math.isfinite(logprob) else _NO_LOGPROB
