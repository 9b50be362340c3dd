"""Server settings and the warm-up that turns them into a running engine."""

import dataclasses
import logging
import time

import jax

from ddtree_jax import drafters, engine, policies
from models import dflash, loading
from models.config import EXPERT_FORMATS, KERNEL_IMPLS, expert_format_overrides, kernel_backend_error, kernel_dtype_error
from serve.engine_loop import (BudgetTable, EngineLoop, FaultInjector, batch_buckets, fault_injector_from_env,
                               parse_batch_buckets)
from serve.metrics import Metrics
from serve.protocol import MAX_TOP_LOGPROBS
from serve.text import TextCodec

log = logging.getLogger("ddtree_jax.serve")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """What ``python -m ddtree_jax.serve`` is told (see its ``--help``).

  Attributes:
    model, drafter: bundled names or checkpoint directories.
    served_model_name: the name clients send as ``model`` (default: the model's name).
    spec: ``none`` (plain autoregressive decoding) or a registered tree policy.
    policy_options: options bound to that policy (``policies.get_policy``), e.g. ``{"width": 4}``.
    budget: the budget table (``BudgetTable.parse``); ignored for ``spec="none"``.
    max_batch: requests decoded together (rows of the largest compiled batch).
    batch_buckets: the batch sizes compiled, e.g. ``"1,4,16"`` (``--batch-buckets``; the largest
      must be ``max_batch``); default the powers of two below ``max_batch`` and ``max_batch``.
      Each bucket is one step executable per budget it serves, and moving rows between two buckets
      one more, so fewer buckets start faster; a batch runs in the smallest bucket that holds it.
    max_context: prompt + generated tokens per request.
    max_queue: requests that may wait for a row before new ones get 429.
    max_body_bytes: request bodies above this get 413.
    dtype: ``auto`` (as stored), ``bfloat16`` or ``float32``.
    prefill_chunk: tokens per compiled prefill chunk.
    api_key: when set, requests need ``Authorization: Bearer <api_key>``.
    attention_impl, moe_impl: the target's tree attention and routed experts: ``xla`` (plain jnp,
      any backend) or ``pallas`` (the Mosaic GPU kernels; GPU only: ``check_backend``).
    experts: the routed experts as the checkpoint stores them (``auto``), quantised to INT4 on
      load (``int4``: a bf16 checkpoint in about a quarter of the memory) or dequantised
      (``dense``); ``models.config.EXPERT_FORMATS``.
    max_logprobs: the most alternatives a request may ask for with each token's log-probability
      (``logprobs`` / ``top_logprobs``); every step computes them on the device for every row (a
      top-n over the vocabulary per tree node) and the host keeps those of the requests that asked;
      -1 computes none and refuses requests for them.
  """

  model: str = "kimi-demo"
  drafter: str = "kimi-demo-dflash"
  served_model_name: str | None = None
  spec: str = "ddtree"
  policy_options: dict = dataclasses.field(default_factory=dict)
  budget: str = "1:32,4:16,16:8,64:4"
  max_batch: int = 16
  batch_buckets: str | None = None
  max_context: int = 1024
  max_queue: int = 256
  max_body_bytes: int = 1 << 20
  max_stop_ids: int = 8
  dtype: str = "auto"
  prefill_chunk: int = 64
  prefill_tokens_per_turn: int = 2048
  compile_cache_dir: str | None = None
  host: str = "127.0.0.1"
  port: int = 8000
  api_key: str | None = None
  attention_impl: str = "xla"
  moe_impl: str = "xla"
  experts: str = "auto"
  max_logprobs: int = 5
  faults: str | None = None  # DDTREE_JAX_FAULTS syntax; tests only

  def __post_init__(self):
    for name in ("max_batch", "max_context", "prefill_chunk", "max_body_bytes", "max_stop_ids",
                 "prefill_tokens_per_turn"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if not -1 <= self.max_logprobs <= MAX_TOP_LOGPROBS:
      raise ValueError(f"max_logprobs must lie in [-1, {MAX_TOP_LOGPROBS}] (-1: none computed), got {self.max_logprobs}")
    if self.max_queue < 0:
      raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
    if not 0 <= self.port <= 65535:  # uvicorn would bind the port modulo 65536
      raise ValueError(f"port must lie in [0, 65535], got {self.port}")
    if self.spec != "none" and self.spec not in policies.available_policies():
      raise ValueError(f"spec {self.spec!r}: expected 'none' or one of {policies.available_policies()}")
    if self.policy_options:
      if self.spec == "none":
        raise ValueError("policy options given with spec 'none' (no tree policy runs)")
      policies.get_policy(self.spec, **self.policy_options)  # names an option the policy does not take
    if self.dtype not in ("auto", "bfloat16", "float32"):
      raise ValueError(f"dtype {self.dtype!r}: expected auto, bfloat16 or float32")
    BudgetTable.parse(self.budget)
    if self.batch_buckets is not None and self.buckets[-1] != self.max_batch:
      raise ValueError(f"--batch-buckets {self.batch_buckets!r}: the largest bucket must be --max-batch "
                       f"({self.max_batch}), got {self.buckets[-1]}")
    for name in ("attention_impl", "moe_impl"):
      if getattr(self, name) not in KERNEL_IMPLS:
        raise ValueError(f"{name} {getattr(self, name)!r}: expected one of {KERNEL_IMPLS}")
    expert_format_overrides(self.experts)  # names a format that does not exist
    if self.dtype != "auto":
      error = kernel_dtype_error(self.dtype, attention_impl=self.attention_impl, moe_impl=self.moe_impl)
      if error:
        raise ValueError(error)

  def check_backend(self, backend: str | None = None) -> None:
    """Raises ValueError, naming the setting, where a ``pallas`` kernel is asked for on a backend
    that cannot run it (``backend``: default jax's), so that a server fails at startup, not in
    its warm-up's first compile."""
    error = kernel_backend_error(backend or jax.default_backend(), attention_impl=self.attention_impl,
                                 moe_impl=self.moe_impl)
    if error:
      raise ValueError(error)

  @property
  def model_name(self) -> str:
    return self.served_model_name or str(self.model).rstrip("/").split("/")[-1]

  @property
  def buckets(self) -> tuple[int, ...]:
    """The batch sizes the server compiles (``batch_buckets``, or powers of two up to ``max_batch``)."""
    return batch_buckets(self.max_batch) if self.batch_buckets is None else parse_batch_buckets(self.batch_buckets)

  @property
  def budget_table(self) -> BudgetTable:
    return BudgetTable((( 1, 0),)) if self.spec == "none" else BudgetTable.parse(self.budget)


@dataclasses.dataclass
class Engine:
  """A warmed-up server engine: the loop, the text codec and the metrics."""

  loop: EngineLoop
  codec: TextCodec
  metrics: Metrics
  config: ServeConfig
  max_context: int
  warmup_seconds: float


def build_engine(config: ServeConfig) -> Engine:
  """Loads the models and compiles every step shape the server can run (the warm-up)."""
  t0 = time.perf_counter()
  config.check_backend()
  model_dir = loading.resolve_model_dir(config.model)
  dtype = {} if config.dtype == "auto" else {"dtype": config.dtype, "param_dtype": config.dtype}
  if config.dtype == "auto":  # the checkpoint's dtype, known once its config is read
    stored = loading.stored_dtype(model_dir)
    error = kernel_dtype_error(stored, attention_impl=config.attention_impl, moe_impl=config.moe_impl)
    if error:
      raise ValueError(f"{error} (the checkpoint is stored in {stored}: pass --dtype bfloat16)")
  target = loading.load_kimi(model_dir, **dtype, **expert_format_overrides(config.experts),
                             attention_impl=config.attention_impl, moe_impl=config.moe_impl)
  if config.max_context > target.cfg.max_position_embeddings:
    raise ValueError(f"--max-context {config.max_context} exceeds the model's max_position_embeddings "
                     f"{target.cfg.max_position_embeddings}")
  codec = TextCodec.from_model_dir(model_dir, eos_token_id=target.cfg.eos_token_id)
  if codec.vocab_size > target.cfg.vocab_size:
    raise ValueError(f"{model_dir}: the tokenizer has {codec.vocab_size} ids, the model's vocabulary "
                     f"{target.cfg.vocab_size}: they do not belong together")
  default_stops = len(set(codec.stop_ids) | set(codec.chat_stop_ids))
  if default_stops > config.max_stop_ids:
    raise ValueError(f"the model's own stop ids ({default_stops}: {sorted(set(codec.stop_ids) | set(codec.chat_stop_ids))}) "
                     f"exceed --max-stop-ids {config.max_stop_ids}, so every chat request would be refused: raise it")
  table = config.budget_table
  buckets = config.buckets
  if config.spec == "none":
    drafter, drafter_params = drafters.RandomDrafter(target.cfg.vocab_size), None
  else:
    draft = loading.load_dflash(config.drafter, **dtype)
    drafter, drafter_params = dflash.DFlashDrafter(draft.cfg), dflash.DFlashDrafter.params(draft, target)
  budgets = table.budgets
  max_q_len = max(budgets) + 1
  metrics = Metrics(max_budget=max(budgets))
  log.info("compiling %d step shapes (buckets %s, budgets %s) on %s", len(buckets), buckets, budgets,
           jax.devices()[0].device_kind)
  decoder = engine.SpeculativeDecoder(
      target, drafter, drafter_params, policy=config.spec if config.spec != "none" else "chain",
      policy_options=config.policy_options,
      budgets=budgets, batch_buckets=buckets,
      bucket_budgets={b: table.budgets_for_bucket(b, prev) for b, prev in zip(buckets, (0,) + buckets[:-1])},
      max_len=config.max_context + max_q_len, prefill_chunk=min(config.prefill_chunk, config.max_context),
      compile_cache_dir=config.compile_cache_dir, max_stop_tokens=config.max_stop_ids,
      logprobs=None if config.max_logprobs < 0 else config.max_logprobs, show_progress=False)
  metrics.compile_seconds.set(decoder.compile_seconds)
  faults = FaultInjector.from_spec(config.faults) if config.faults else fault_injector_from_env()
  loop = EngineLoop(decoder, table, metrics, max_queue=config.max_queue,
                    prefill_tokens_per_turn=config.prefill_tokens_per_turn, faults=faults)
  return Engine(loop=loop, codec=codec, metrics=metrics, config=config, max_context=config.max_context,
                warmup_seconds=time.perf_counter() - t0)
