"""Prometheus metrics of the engine and the server (``GET /metrics``), each on its own registry so
several engines (tests, benchmarks) can live in one process."""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics"]

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    def __init__(self, model_name: str = "model", window_s: float = 10.0):
        r = self.registry = CollectorRegistry()
        lab = ["model_name"]
        self.ttft = Histogram("glm5_time_to_first_token_seconds", "Submit to first generated token", lab, registry=r,
                              buckets=_LAT)
        self.itl = Histogram("glm5_inter_token_latency_seconds", "Between consecutive generated tokens of a request",
                             lab, registry=r, buckets=_LAT)
        self.e2e = Histogram("glm5_request_latency_seconds", "Submit to finish", lab, registry=r, buckets=_LAT)
        self.gen = Counter("glm5_generation_tokens", "Generated tokens", lab, registry=r)
        self.prompt = Counter("glm5_prompt_tokens", "Prompt tokens (prefilled + reused)", lab, registry=r)
        self.reused = Counter("glm5_prefix_reused_tokens", "Prompt tokens taken from a cached prefix", lab, registry=r)
        self.finished = Counter("glm5_requests_finished", "Finished requests by reason", lab + ["finish_reason"],
                                registry=r)
        self.tps = Gauge("glm5_generation_tokens_per_second", f"Generated tokens/s over the last {window_s:g} s", lab,
                         registry=r)
        self.queue = Gauge("glm5_queue_length", "Requests waiting for a slot", lab, registry=r)
        self.occupancy = Gauge("glm5_batch_occupancy", "Busy slots / max_batch", lab, registry=r)
        self.running = Gauge("glm5_running_requests", "Requests holding a slot", lab, registry=r)
        self.acceptance = Gauge("glm5_spec_acceptance_length", "Speculative decoding: mean 1 + accepted drafts per "
                                "verification (1 without speculation)", lab, registry=r)
        self.accept_rate = Gauge("glm5_spec_acceptance_rate", "Speculative decoding: acceptance rate per draft depth",
                                 lab + ["depth"], registry=r)
        self.host_gap = Histogram("glm5_step_host_gap_seconds", "Host time between two back-to-back steps (outputs "
                                  "back, tokens delivered, next step planned and dispatched)", lab, registry=r,
                                  buckets=_LAT)
        self.pages = Gauge("glm5_kv_pages", "Paged KV cache pages by state: free, cached (held only by the prefix "
                           "tree, evictable), running (held by running requests), total", lab + ["state"], registry=r)
        self.prefix_hit = Gauge("glm5_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens "
                                "looked up", lab, registry=r)
        self.acceptance.labels(model_name).set(1.0)
        self.name, self.window = model_name, window_s
        self._times = collections.deque()

    def observe_token(self, h, now: float) -> None:
        n = self.name
        if len(h.token_times) == 1:
            self.ttft.labels(n).observe(now - h.submitted)
        else:
            self.itl.labels(n).observe(now - h.token_times[-2])
        self.gen.labels(n).inc()
        self._times.append(now)

    def observe_finish(self, h) -> None:
        n = self.name
        self.e2e.labels(n).observe(time.perf_counter() - h.submitted)
        self.prompt.labels(n).inc(len(h.prompt))
        self.reused.labels(n).inc(h.reused_tokens)
        self.finished.labels(n, h.finish_reason or "unknown").inc()

    def observe_host_gap(self, seconds: float) -> None:
        self.host_gap.labels(self.name).observe(seconds)

    def observe_engine(self, engine) -> None:
        n, now = self.name, time.perf_counter()
        while self._times and self._times[0] < now - self.window:
            self._times.popleft()
        self.tps.labels(n).set(len(self._times) / self.window)
        self.queue.labels(n).set(engine.queue_length)
        self.running.labels(n).set(engine.active)
        self.occupancy.labels(n).set(engine.active / engine.max_batch)
        rt = getattr(engine, "runtime", None)
        if rt is not None:
            for state, v in rt.pages_in_use().items():
                self.pages.labels(n, state).set(v)
            if rt.radix is not None and rt.radix.queried_tokens:
                self.prefix_hit.labels(n).set(rt.radix.hit_tokens / rt.radix.queried_tokens)
        acc = getattr(engine, "acceptance", None)
        if acc:
            self.acceptance.labels(n).set(acc["length"])
            for d, rate in enumerate(acc.get("per_depth", ())):
                self.accept_rate.labels(n, str(d + 1)).set(rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
