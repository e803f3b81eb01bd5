"""Serving metrics in Prometheus form (the server's /metrics): request counts, tokens, latencies, queue
depths and KV-cache use. Each ServingMetrics has its own registry, so several servers (tests) coexist.

The gauges read the engine's scheduler when scraped, from the server's thread: a list length or a
free-block count read while the engine thread steps is at worst one step old.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from fastllm.engine.llm_engine import LLMEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class ServingMetrics:
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, engine: LLMEngine):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("fastllm_requests", "Finished requests, by finish reason", ["finish_reason"],
                                registry=registry)
        self.prompt_tokens = Counter("fastllm_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter("fastllm_generation_tokens", "Generated tokens", registry=registry)
        self.time_to_first_token = Histogram("fastllm_time_to_first_token_seconds", "Time to first token",
                                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e_latency = Histogram("fastllm_e2e_request_latency_seconds", "Request latency, arrival to last token",
                                     buckets=_LATENCY_BUCKETS, registry=registry)
        scheduler = engine.scheduler
        Gauge("fastllm_num_requests_running", "Requests in the running queue",
              registry=registry).set_function(lambda: len(scheduler.running))
        Gauge("fastllm_num_requests_waiting", "Requests waiting to start or resume",
              registry=registry).set_function(lambda: len(scheduler.waiting))
        Gauge("fastllm_num_requests_swapped", "Requests swapped out to the CPU",
              registry=registry).set_function(lambda: len(scheduler.swapped))
        Gauge("fastllm_kv_cache_usage_perc", "Fraction of the GPU KV blocks in use",
              registry=registry).set_function(lambda: scheduler.kv.usage)
        if engine.config.speculative.enabled:
            registry.register(_SpecDecodingCollector(scheduler.spec_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodingCollector:
    """The scheduler's speculative-decoding counts, read when scraped."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        for name, doc, value in (
            ("fastllm_spec_decode_num_drafts", "Verifications of a request's draft tokens", self.stats.num_drafts),
            ("fastllm_spec_decode_num_draft_tokens", "Draft tokens verified", self.stats.num_draft_tokens),
            ("fastllm_spec_decode_num_accepted_tokens", "Draft tokens the target accepted",
             self.stats.num_accepted_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=value)
