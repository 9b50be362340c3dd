"""The engine loop: one thread that owns the decoder and runs continuous batching for the server.

Each turn of the loop
  1. takes new jobs and cancellations from its inbox (the HTTP side never touches the engine),
  2. moves the running rows to the smallest compiled batch bucket that holds them and the queue,
  3. admits waiting jobs into free rows (chunked prefill into a fresh cache slot; at most
     ``prefill_tokens_per_turn`` prompt tokens per turn, so long prompts do not stall the batch),
  4. dispatches the next step at the budget the bucket's entry in the budget table names,
  5. reads the previous step (already finished on the device while step 4 was being enqueued)
     and hands each job its new text.

A failure is contained: a failed admission fails that job alone; a failed step fails the jobs
in that step, and the loop starts a fresh batch (and fresh caches if the failure consumed them)
for the jobs still queued.
"""

import collections
import dataclasses
import logging
import os
import queue
import random
import threading
import time
import uuid
from typing import Callable, Sequence

import jax

from ddtree_jax import engine
from serve.metrics import Metrics
from serve.text import StreamText

log = logging.getLogger("ddtree_jax.serve")

FAULT_ENV = "DDTREE_JAX_FAULTS"


class QueueFull(RuntimeError):
  """The admission queue is at its bound (HTTP 429)."""


class InjectedFault(RuntimeError):
  """A failure the fault-injection hook raised on purpose."""


@dataclasses.dataclass(frozen=True)
class BudgetTable:
  """Tree budget by running batch size: ``((max_batch_size, budget), ...)`` in increasing size.

  A batch of n running requests uses the budget of the first entry whose size is >= n (the last
  entry covers anything larger). ``"16"`` means budget 16 at every size; ``"1:32,8:16,64:8"``
  means 32 for one request, 16 up to 8, 8 beyond.
  """

  entries: tuple[tuple[int, int], ...]

  @classmethod
  def parse(cls, text: str) -> "BudgetTable":
    text = str(text).strip()
    try:
      if ":" not in text:
        entries = [(1, int(text))]
      else:
        entries = []
        for part in text.split(","):
          size, budget = part.split(":")
          entries.append((int(size), int(budget)))
    except ValueError:
      raise ValueError(f"--budget {text!r}: expected an int or 'size:budget,size:budget,...'") from None
    if any(size <= 0 or budget < 0 for size, budget in entries):
      raise ValueError(f"--budget {text!r}: sizes must be positive and budgets non-negative")
    sizes = [size for size, _ in entries]
    if sizes != sorted(set(sizes)):
      raise ValueError(f"--budget {text!r}: batch sizes must increase")
    return cls(tuple(entries))

  def budgets_for_bucket(self, bucket: int, smaller_bucket: int) -> tuple[int, ...]:
    """The budgets a bucket may run: one per running batch size in (smaller_bucket, bucket]."""
    return tuple(sorted({self.budget_for(n) for n in range(smaller_bucket + 1, bucket + 1)}))

  def budget_for(self, batch_size: int) -> int:
    for size, budget in self.entries:
      if batch_size <= size:
        return budget
    return self.entries[-1][1]

  @property
  def budgets(self) -> tuple[int, ...]:
    return tuple(sorted({budget for _, budget in self.entries}))


def batch_buckets(max_batch: int) -> tuple[int, ...]:
  """Powers of two below ``max_batch``, and ``max_batch``."""
  buckets, b = [], 1
  while b < max_batch:
    buckets.append(b)
    b *= 2
  return tuple(buckets + [max_batch])


def parse_batch_buckets(spec: str) -> tuple[int, ...]:
  """``--batch-buckets``: batch sizes to compile, e.g. ``"1,4,16"`` (increasing, positive).

  Raises:
    ValueError: naming the flag and what is wrong with ``spec``.
  """
  try:
    buckets = tuple(int(part) for part in spec.split(","))
  except ValueError:
    raise ValueError(f"--batch-buckets {spec!r}: expected comma-separated batch sizes, e.g. '1,4,16'") from None
  if min(buckets) < 1:
    raise ValueError(f"--batch-buckets {spec!r}: batch sizes must be positive")
  if any(a >= b for a, b in zip(buckets, buckets[1:])):
    raise ValueError(f"--batch-buckets {spec!r}: batch sizes must increase")
  return buckets


class FaultInjector:
  """Makes chosen engine steps fail (tests only).

  ``spec`` is ``"steps=3,17"`` (those step numbers, counted from 1 across the server's life) or
  ``"rate=0.05;seed=1"`` (each step fails with that probability); fields are separated by ``;``.
  Read from ``$DDTREE_JAX_FAULTS``.
  """

  def __init__(self, steps: Sequence[int] = (), rate: float = 0.0, seed: int = 0):
    self.steps = set(int(s) for s in steps)
    self.rate = float(rate)
    self._rng = random.Random(seed)
    self.count = 0
    self.injected = 0

  @classmethod
  def from_spec(cls, spec: str | None) -> "FaultInjector | None":
    if not spec:
      return None
    fields = dict(part.split("=", 1) for part in spec.split(";") if part)
    bad = set(fields) - {"steps", "rate", "seed"}
    if bad:
      raise ValueError(f"{FAULT_ENV}={spec!r}: unknown fields {sorted(bad)} (use steps=, rate=, seed=)")
    steps = [int(s) for s in fields.get("steps", "").split(",") if s]
    return cls(steps, float(fields.get("rate", 0.0)), int(fields.get("seed", 0)))

  def before_step(self) -> None:
    self.count += 1
    if self.count in self.steps or (self.rate and self._rng.random() < self.rate):
      self.injected += 1
      raise InjectedFault(f"injected engine fault at step {self.count}")


@dataclasses.dataclass
class Event:
  """What a job's consumer receives: new text, then a last event with ``finish_reason`` or ``error``."""

  text: str = ""
  completion_tokens: int = 0
  finish_reason: str | None = None
  error: str | None = None
  # The request's own token list, not a copy: the engine only ever appends to it, so its first
  # ``completion_tokens`` ids stay this event's. Copying them into every event cost a request
  # O(its length) a step.
  tokens: Sequence[int] = ()
  # The request's logprobs.TokenLogprob list (one a token when the engine computes them), held the
  # same way.
  logprobs: Sequence = ()
  prompt_logprobs: Sequence = ()  # each prompt token's after the first, when the request asked

  def token_ids(self, start: int = 0) -> list[int]:
    """The event's token ids from index ``start`` on (all of them by default)."""
    return list(self.tokens[start:self.completion_tokens])

  def token_logprobs(self, start: int = 0) -> list:
    """The TokenLogprob of each of the event's tokens from index ``start`` on."""
    return list(self.logprobs[start:self.completion_tokens])


@dataclasses.dataclass(eq=False)
class Job:
  """One HTTP request as the engine sees it.

  ``sink`` receives Events from the engine thread; it must not block (the HTTP side passes a
  function that hands the event to its event loop).
  """

  request: engine.Request
  text: StreamText
  sink: Callable[[Event], None]
  id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
  arrival: float = dataclasses.field(default_factory=time.perf_counter)
  first_token_at: float | None = None
  consumed: int = 0  # tokens already turned into events
  done: bool = False
  counted: bool = True  # in the request and token metrics (the server's warm-up request is not)
  # Stop ids whose own text the output leaves out: the model's (EOS, a chat turn's end). An id the
  # request adds in ``stop_token_ids`` keeps its text, as vLLM returns it (special tokens decode to
  # nothing anyway), so text, ``token_ids``, ``usage`` and logprobs all hold the same tokens.
  textless_stop_ids: frozenset = frozenset()

  @property
  def prompt_tokens(self) -> int:
    return int(self.request.prompt.size)


class EngineLoop:
  """Runs a ``SpeculativeDecoder`` for many concurrent jobs on one thread.

  Args:
    decoder: compiled for ``batch_buckets(max_batch)`` and, per bucket, the budgets
      ``budgets.budgets_for_bucket`` names (the budget follows the number of running requests).
    budgets: the budget table.
    max_queue: jobs that may wait beyond the free rows; ``submit`` raises QueueFull past it.
    prefill_tokens_per_turn: prompt tokens admitted per loop turn (at least one job is).
  """

  def __init__(self, decoder: engine.SpeculativeDecoder, budgets: BudgetTable, metrics: Metrics, *,
               max_queue: int = 256, prefill_tokens_per_turn: int = 2048, faults: FaultInjector | None = None):
    self.decoder = decoder
    self.budgets = budgets
    self.metrics = metrics
    self.max_queue = max_queue
    self.prefill_tokens_per_turn = prefill_tokens_per_turn
    self.faults = faults
    self._inbox: "queue.SimpleQueue[tuple[str, Job | None]]" = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._queued = 0  # jobs submitted and not yet admitted (the bounded queue)
    self._running = 0  # rows in use: set at the end of each turn, raised as each admission lands (read by ``submit``)
    self._waiting: collections.deque[Job] = collections.deque()
    self._jobs: dict[engine.Request, Job] = {}
    # Requests kept out of the metrics (the warm-up's), remembered past their jobs: a step already
    # dispatched when its job ends is read back after.
    self._uncounted: set[engine.Request] = set()
    self._batch = engine.Batch(decoder, decoder.batch_buckets[0])
    self._pending = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)
    self.steps = 0
    self.last_error: BaseException | None = None
    metrics.free_slots.set(decoder.pool.free_slots)
    metrics.batch_bucket.set(self._batch.bucket)

  # ---- called from any thread ------------------------------------------------------------
  def start(self) -> None:
    self._thread.start()

  def shutdown(self, timeout: float = 30.0) -> None:
    self._stop.set()
    self._inbox.put(("wake", None))
    self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def is_engine_thread(self) -> bool:
    return threading.current_thread() is self._thread

  def submit(self, job: Job) -> None:
    with self._lock:
      free_rows = max(0, self.decoder.max_batch - self._running)
      if self._queued >= self.max_queue + free_rows:
        raise QueueFull(f"the admission queue is full ({self.max_queue} requests waiting for a row); retry later")
      self._queued += 1
      self.metrics.queue_depth.set(self._queued)
    self._inbox.put(("submit", job))

  def cancel(self, job: Job) -> None:
    """Ends ``job`` (its client went away): its slot is freed on the loop's next turn."""
    self._inbox.put(("cancel", job))

  # ---- the engine thread -------------------------------------------------------------------
  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        self._turn()
      except Exception as err:  # pylint: disable=broad-except
        # Unexpected (not a step failure): fail what is running, keep serving the queue.
        log.exception("engine loop error")
        try:
          self._fail_running(err)
        except Exception:  # pylint: disable=broad-except
          log.exception("recovering from an engine loop error failed")
    self._fail_all(RuntimeError("the server is shutting down"))

  def _turn(self) -> None:
    idle = not (self._batch.num_running or self._waiting or self._pending)
    if idle:
      self._batch.mark_idle()  # the next step's wall time starts at its dispatch, not at the last step
    self._read_inbox(block=idle)
    batch = self._batch
    want = min(self.decoder.max_batch, batch.num_running + len(self._waiting))
    bucket = self.decoder.bucket_for(max(want, 1))
    if bucket != batch.bucket and batch.num_running <= bucket:
      batch.resize(bucket)
      self.metrics.batch_bucket.set(bucket)
    self._admit()

    dispatched, step_error = None, None
    if batch.num_running:
      try:
        self.steps += 1
        if self.faults is not None:
          self.faults.before_step()
        dispatched = batch.dispatch(self._budget(batch))
      except Exception as err:  # pylint: disable=broad-except
        step_error = err
    if self._pending is not None:
      handle, self._pending = self._pending, None
      try:
        stats = batch.collect(handle)
      except Exception as err:  # pylint: disable=broad-except
        log.exception("reading a step failed")
        self._fail_running(err)
        return
      requests = [r for r in handle[2] if r is not None]
      if not all(r in self._uncounted for r in requests):  # the warm-up's steps stay out of the metrics
        self._observe(stats)
      self._publish(requests)
    if step_error is not None:
      log.warning("engine step failed: %s", step_error)
      self._fail_running(step_error)
      return
    self._pending = dispatched
    self._running = batch.num_running
    self.metrics.running.set(batch.num_running)
    self.metrics.free_slots.set(self.decoder.pool.free_slots)

  def _budget(self, batch: engine.Batch) -> int:
    """The table's budget for the running requests, counted within the bucket's compiled range.

    A bucket is compiled for the budgets of (next smaller bucket, bucket] running requests. It is
    chosen for the running and waiting requests before admission, which may take fewer of them
    (the per-turn prefill limit, a failed admission): fewer running requests then run at the
    budget of the smallest count the bucket serves rather than at one it was never compiled for.
    """
    smaller = max((b for b in self.decoder.batch_buckets if b < batch.bucket), default=0)
    return self.budgets.budget_for(max(batch.num_running, smaller + 1))

  def _read_inbox(self, block: bool) -> None:
    try:
      kind, job = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
    except queue.Empty:
      return
    while True:
      if kind == "submit":
        self._waiting.append(job)
      elif kind == "cancel":
        self._cancel(job)
      try:
        kind, job = self._inbox.get_nowait()
      except queue.Empty:
        return

  def _cancel(self, job: Job) -> None:
    if job.done:
      return
    job.done = True
    if job.counted:
      self.metrics.finished.labels("cancelled").inc()
    if job in self._waiting:
      self._waiting.remove(job)
      self._dequeued(1)
      return
    if not job.request.finished:
      self._batch.cancel(job.request)
    self._jobs.pop(job.request, None)
    self.metrics.free_slots.set(self.decoder.pool.free_slots)

  def _dequeued(self, n: int) -> None:
    with self._lock:
      self._queued -= n
      self.metrics.queue_depth.set(self._queued)

  def _admit(self) -> None:
    admitted_tokens = 0
    while self._waiting and self._batch.free_rows() and (
        admitted_tokens == 0 or admitted_tokens + self._waiting[0].prompt_tokens <= self.prefill_tokens_per_turn):
      job = self._waiting.popleft()
      try:
        self._batch.admit(job.request)
      except Exception as err:  # pylint: disable=broad-except
        self._dequeued(1)
        log.warning("admission failed: %s", err)
        self._finish(job, error=f"admission failed: {err}")
        if not self._caches_usable(with_decode=True):
          self._fail_running(err)  # counts the failure
          return
        self.metrics.engine_failures.inc()
        continue
      with self._lock:  # queued until now, running from now on: ``submit`` never sees it in neither
        self._queued -= 1
        self._running += 1
        self.metrics.queue_depth.set(self._queued)
      admitted_tokens += job.prompt_tokens
      self._jobs[job.request] = job
      if job.counted:
        self.metrics.prompt_tokens.inc(job.prompt_tokens)
      else:
        self._uncounted.add(job.request)

  def _observe(self, stats: engine.StepStats) -> None:
    self.metrics.step_seconds.labels(str(stats.budget)).observe(stats.step_time)
    for accepted in stats.accepted:
      self.metrics.accepted_length.observe(accepted)

  def _publish(self, requests: list[engine.Request]) -> None:
    """Hands each job of a collected step its new text; ends jobs that finished or hit a stop string."""
    now = time.perf_counter()
    for request in requests:
      job = self._jobs.get(request)
      if job is None or job.done:
        continue
      tokens = request.tokens
      if len(tokens) > job.consumed and job.first_token_at is None:
        job.first_token_at = now
        if job.counted:
          self.metrics.ttft.observe(now - job.arrival)
      finished = request.finished
      visible = tokens
      if finished and request.finish_reason == "stop" and tokens and tokens[-1] in job.textless_stop_ids:
        visible = tokens[:-1]  # the model's end-of-text id ends the text; its own spelling is not part of it
      text = job.text.push(visible, final=finished)
      # Report the tokens up to the one that completes a stop string: a step that emitted several
      # tokens past it (speculation) must not change what the client is told, or the metrics.
      reported = job.text.tokens_through(visible, *job.text.stop_match) if job.text.stopped else len(tokens)
      if job.counted and reported > job.consumed:
        self.metrics.generated_tokens.inc(reported - job.consumed)
      job.consumed = max(job.consumed, reported)
      if job.text.stopped:
        if not finished:
          self._batch.cancel(request, reason="stop")
        self._finish(job, text=text, reason="stop", num_tokens=reported)
      elif finished:
        self._finish(job, text=text, reason=request.finish_reason)
      elif text:
        job.sink(Event(text=text, completion_tokens=len(tokens), tokens=tokens, logprobs=request.logprobs,
                       prompt_logprobs=request.prompt_logprobs))

  def _finish(self, job: Job, *, text: str = "", reason: str | None = None, error: str | None = None,
              num_tokens: int | None = None) -> None:
    if job.done:
      return
    job.done = True
    self._jobs.pop(job.request, None)
    if job.counted:
      self.metrics.finished.labels(reason or "error").inc()
    tokens = job.request.tokens
    count = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
    job.sink(Event(text=text, completion_tokens=count, tokens=tokens, logprobs=job.request.logprobs,
                   prompt_logprobs=job.request.prompt_logprobs, finish_reason=reason, error=error))

  def _caches_usable(self, with_decode: bool = False) -> bool:
    """False if a failure deleted the caches (donation) or left them holding an error; with
    ``with_decode``, the batch's decode state too."""
    state = (self.decoder.target_cache, self.decoder.drafter_state) + ((self._batch.decode,) if with_decode else ())
    leaves = jax.tree.leaves(state)
    try:
      if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in leaves):
        return False
      jax.block_until_ready(leaves)  # raises if an asynchronous failure poisoned them
      return True
    except Exception:  # pylint: disable=broad-except
      return False

  def _fail_running(self, err: BaseException) -> None:
    """Fails every admitted job (all belong to the batch being dropped) and starts afresh.

    The caches are rebuilt (from an executable compiled at warm-up) when the failed step consumed
    its donated buffers or left them holding an error; intact caches are kept, since rebuilding
    churns memory. Jobs still waiting are untouched.
    """
    self.last_error = err
    self.metrics.engine_failures.inc()
    self._pending = None
    message = f"engine step failed: {err}"
    for job in list(self._jobs.values()):
      self._finish(job, error=message)
    self._batch.close()
    if not self._caches_usable():
      log.warning("the failed step consumed or poisoned the caches; rebuilding them")
      self.decoder.reset_caches()
    self._batch = engine.Batch(self.decoder, self._batch.bucket)
    self._running = 0
    self.metrics.running.set(0)
    self.metrics.free_slots.set(self.decoder.pool.free_slots)

  def _fail_all(self, err: BaseException) -> None:
    self._fail_running(err)
    while self._waiting:
      self._finish(self._waiting.popleft(), error=str(err))
    while True:
      try:
        kind, job = self._inbox.get_nowait()
      except queue.Empty:
        return
      if kind == "submit":
        self._finish(job, error=str(err))

  # ---- introspection (tests, /metrics) -----------------------------------------------------
  def snapshot(self) -> dict:
    return {"running": self._batch.num_running, "waiting": len(self._waiting), "queued": self._queued,
            "free_slots": self.decoder.pool.free_slots, "num_slots": self.decoder.num_slots,
            "bucket": self._batch.bucket, "steps": self.steps, "jobs": len(self._jobs)}


def fault_injector_from_env() -> FaultInjector | None:
  return FaultInjector.from_spec(os.environ.get(FAULT_ENV))
