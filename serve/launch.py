"""Starting a server: warm-up in the background, uvicorn in front (from the CLI, in a thread, or as
a child process)."""

import contextlib
import json
import logging
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
import uvicorn

from serve.app import ServerState, create_app
from serve.config import Engine, ServeConfig, build_engine
from serve.engine_loop import Event, Job
from serve.text import StreamText

log = logging.getLogger("ddtree_jax.serve")

# Every new executable is lowered first, also when the persistent compilation cache then has it.
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_compile_watchers: list = []


def _on_jax_event(event: str, duration: float, **_kwargs) -> None:
  # Listeners run on the compiling thread: a compile belongs to the engine whose loop thread it is.
  if event == _LOWERING_EVENT:
    for engine in list(_compile_watchers):
      if engine.loop.is_engine_thread():
        engine.metrics.compiles_after_warmup.inc()


jax.monitoring.register_event_duration_secs_listener(_on_jax_event)


def warm_up(config: ServeConfig) -> Engine:
  """Builds the engine, starts its loop and runs one request through it (admission, a step and
  the read-back run once before the server reports ready). Compiles after this are counted in
  ``ddtree_compiles_after_warmup``."""
  engine = build_engine(config)
  engine.loop.start()
  done = threading.Event()
  events: list[Event] = []

  def sink(event: Event) -> None:
    events.append(event)
    if event.finish_reason or event.error:
      done.set()

  request = engine.loop.decoder.request(np.asarray([engine.codec.eos_token_id], np.int32), 2, stop_token_ids=[])
  engine.loop.submit(Job(request=request, text=StreamText(engine.codec), sink=sink, counted=False))
  if not done.wait(600) or events[-1].error:
    raise RuntimeError(f"warm-up request failed: {events[-1].error if events else 'timed out'}")
  _compile_watchers.append(engine)
  return engine


def start_warm_up(state: ServerState, config: ServeConfig) -> threading.Thread:
  """Warms up in a thread so that /health answers (503, loading) meanwhile."""

  def run():
    t0 = time.perf_counter()
    try:
      state.set_engine(warm_up(config))
    except Exception as err:  # pylint: disable=broad-except
      log.exception("warm-up failed")
      state.load_error = f"{type(err).__name__}: {err}"
      return
    log.info("ready in %.1f s: %s, spec %s, budget table %s, batch buckets %s", time.perf_counter() - t0,
             config.model_name, config.spec, state.engine.loop.budgets.entries,
             state.engine.loop.decoder.batch_buckets)

  thread = threading.Thread(target=run, name="ddtree-warmup", daemon=True)
  thread.start()
  return thread


class ServerThread:
  """A server on a background thread (tests, notebooks): ``with ServerThread(config) as s: s.url``.

  Pass ``engine`` to serve an engine that is already warm (several apps may share one).
  """

  def __init__(self, config: ServeConfig, engine: Engine | None = None, *, wait_ready: bool = True,
               timeout: float = 900.0):
    config.check_backend()  # before a socket or thread exists
    self.config = config
    self.state = ServerState(api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    self.app = create_app(self.state)
    self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._sock.bind((config.host, config.port))
    self.port = self._sock.getsockname()[1]
    self.url = f"http://{config.host}:{self.port}"
    self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_keep_alive=30))
    self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
    self._thread.start()
    self._owns_engine = engine is None
    if engine is not None:
      self.state.set_engine(engine)
    else:
      start_warm_up(self.state, config)
    if wait_ready:
      self.wait_ready(timeout)

  @property
  def engine(self) -> Engine | None:
    return self.state.engine

  def wait_ready(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not self.state.ready.wait(0.2):
      if self.state.load_error:
        raise RuntimeError(f"server warm-up failed: {self.state.load_error}")
      if time.monotonic() > deadline:
        raise TimeoutError(f"server not ready after {timeout} s")

  def close(self) -> None:
    self.server.should_exit = True
    self._thread.join(30)
    if self._owns_engine and self.state.engine is not None:
      self.state.engine.loop.shutdown()
      if self.state.engine in _compile_watchers:
        _compile_watchers.remove(self.state.engine)
    self._sock.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


@contextlib.contextmanager
def server_process(cli_args: Sequence[str], *, ready_timeout: float = 900.0, health_seen: list | None = None):
  """``python -m ddtree_jax.serve`` with ``cli_args`` in a child process on a free loopback port,
  as an operator runs it (benchmarks, whose load generator should not share the server's
  interpreter lock, and the CLI's tests). Yields its URL once ``/health`` answers 200; appends each
  answer's (status code, status) to ``health_seen``. Raises RuntimeError with the server's output
  if it exits or is not ready in ``ready_timeout`` seconds. Stops it on leaving."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  cmd = [sys.executable, "-m", "ddtree_jax.serve", *cli_args, "--host", "127.0.0.1", "--port", str(port)]
  url = f"http://127.0.0.1:{port}"
  with tempfile.TemporaryFile("w+") as output:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=output, stderr=subprocess.STDOUT,
                            text=True)
    try:
      while True:
        if proc.poll() is not None or time.monotonic() - start > ready_timeout:
          output.seek(0)
          state = f"exited with {proc.returncode}" if proc.returncode is not None else f"not ready in {ready_timeout:g} s"
          raise RuntimeError(f"the server {state}: {' '.join(cmd)}\n{output.read()[-4000:]}")
        code, status = _health(url)
        if code is not None and health_seen is not None:
          health_seen.append((code, status))
        if code == 200:
          break
        time.sleep(0.25)
      yield url
    finally:
      proc.terminate()
      try:
        proc.wait(30)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _health(url: str) -> tuple[int | None, str | None]:
  """(status code, the body's status) of ``GET /health``; (None, None) while nothing listens."""
  try:
    with urllib.request.urlopen(url + "/health", timeout=5) as reply:
      code, body = reply.status, reply.read()
  except urllib.error.HTTPError as err:
    code, body = err.code, err.read()
  except (urllib.error.URLError, ConnectionError, TimeoutError):
    return None, None
  try:
    return code, json.loads(body).get("status")
  except (ValueError, AttributeError):
    return code, None


def serve_forever(config: ServeConfig) -> int:
  """The CLI's server: warm-up in the background, uvicorn in the foreground until interrupted.

  Returns the process's exit status: 0 after an interrupt, 1 when the warm-up failed (a model that
  does not load, a step that does not compile), so that a supervisor sees a failed start rather
  than a server answering 503 forever, and 3 (as uvicorn's own) when the port cannot be bound."""
  config.check_backend()
  # The socket first: a port that is taken ends the process before the warm-up thread starts (a
  # process leaving while that thread compiles can crash in the runtime's teardown).
  sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((config.host, config.port))
  except OSError as err:
    sock.close()
    log.error("cannot listen on %s:%d: %s", config.host, config.port, err)
    return 3
  state = ServerState(api_key=config.api_key, max_body_bytes=config.max_body_bytes)
  server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="info", timeout_keep_alive=30))
  start_warm_up(state, config)

  def stop_on_failed_warm_up():
    while not state.ready.wait(0.2):
      if state.load_error:
        log.error("warm-up failed, shutting down: %s", state.load_error)
        server.should_exit = True
        return

  threading.Thread(target=stop_on_failed_warm_up, name="ddtree-warmup-watch", daemon=True).start()
  try:
    server.run(sockets=[sock])
  finally:
    if state.engine is not None:
      state.engine.loop.shutdown()
    sock.close()
  return 1 if state.load_error else 0
