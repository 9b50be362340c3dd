"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""

import prometheus_client as prom

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
  """Every metric the server exports, prefixed ``ddtree_``."""

  def __init__(self, max_budget: int):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self.requests = prom.Counter("ddtree_requests", "HTTP requests by endpoint and status code",
                                 ["endpoint", "status"], registry=r)
    self.prompt_tokens = prom.Counter("ddtree_prompt_tokens", "Prompt tokens admitted", registry=r)
    self.generated_tokens = prom.Counter("ddtree_generated_tokens", "Tokens generated", registry=r)
    self.finished = prom.Counter("ddtree_finished_requests", "Requests that left the engine, by reason",
                                 ["reason"], registry=r)
    self.accepted_length = prom.Histogram(
        "ddtree_acceptance_length", "Tokens committed per request per step (accepted drafts + 1)",
        buckets=tuple(float(i) for i in range(1, max_budget + 2)), registry=r)
    self.step_seconds = prom.Histogram("ddtree_step_seconds", "Wall time of one engine step, by budget",
                                       ["budget"], buckets=_LATENCY_BUCKETS, registry=r)
    self.ttft = prom.Histogram("ddtree_time_to_first_token_seconds", "Arrival to first token",
                               buckets=_REQUEST_BUCKETS, registry=r)
    self.running = prom.Gauge("ddtree_running_requests", "Requests in the running batch", registry=r)
    self.batch_bucket = prom.Gauge("ddtree_batch_bucket", "Rows of the compiled batch the engine runs", registry=r)
    self.queue_depth = prom.Gauge("ddtree_queue_depth", "Requests waiting for a batch row", registry=r)
    self.free_slots = prom.Gauge("ddtree_free_slots", "Free cache slots", registry=r)
    self.compile_seconds = prom.Gauge("ddtree_compile_seconds", "Seconds spent compiling at warm-up", registry=r)
    self.compiles_after_warmup = prom.Counter(
        "ddtree_compiles_after_warmup", "Executables lowered (compiled) by the engine after warm-up (stays 0)", registry=r)
    self.engine_failures = prom.Counter("ddtree_engine_failures", "Engine steps or admissions that failed",
                                        registry=r)

  def render(self) -> bytes:
    return prom.generate_latest(self.registry)
