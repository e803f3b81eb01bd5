"""Serving metrics in Prometheus form (the server's /metrics): request counts, tokens, latencies, queue
depths, KV-cache use and engine steps. Each ServingMetrics has its own registry, so several servers
(tests) coexist.

The engine's numbers come with its outputs: every step's message carries the core's SchedulerStats
(queue depths and KV use after that step, running totals of steps), and a scrape reads the latest.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class ServingMetrics:
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, engine):
        """engine: an AsyncLLMEngine or an LLMEngine (its `stats` are the core's, as of its last step)."""
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
        for name, doc, field in (
            ("fastllm_num_requests_running", "Requests in the running queue", "num_running"),
            ("fastllm_num_requests_waiting", "Requests waiting to start or resume", "num_waiting"),
            ("fastllm_num_requests_swapped", "Requests swapped out to the CPU", "num_swapped"),
            ("fastllm_kv_cache_usage_perc", "Fraction of the GPU KV blocks in use", "kv_usage"),
        ):
            Gauge(name, doc, registry=registry).set_function(lambda field=field: getattr(engine.stats, field))
        registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The core's running totals: steps, their time and batch, preemptions, speculative decoding."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        for name, doc, value in (
            ("fastllm_engine_steps", "Engine steps that computed something", s.num_steps),
            ("fastllm_engine_step_seconds", "Wall time of those steps", s.step_seconds),
            ("fastllm_engine_step_wait_seconds", "Of it, waiting for the GPU's tokens", s.step_wait_seconds),
            ("fastllm_engine_step_cpu_seconds", "CPU time of the stepping thread in those steps (the rest of "
             "the wall time it was off the CPU)", s.step_cpu_seconds),
            ("fastllm_engine_scheduled_requests", "Requests in those steps, summed (/ steps: mean batch)",
             s.num_scheduled_requests),
            ("fastllm_engine_slow_steps", "Steps that took over a second (each logged)", s.num_slow_steps),
            ("fastllm_engine_compiles", "Triton kernels and torch.compile graphs compiled during steps",
             s.num_compiles),
            ("fastllm_num_preemptions", "Requests preempted", s.num_preemptions),
            ("fastllm_spec_decode_num_drafts", "Verifications of a request's draft tokens",
             s.spec_num_drafts),
            ("fastllm_spec_decode_num_draft_tokens", "Draft tokens verified", s.spec_num_draft_tokens),
            ("fastllm_spec_decode_num_accepted_tokens", "Draft tokens the target accepted",
             s.spec_num_accepted_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if s.spec_num_drafts:  # the counters' ratios, as vLLM exports them
            yield GaugeMetricFamily("fastllm_spec_decode_acceptance_rate", "Draft tokens accepted / verified",
                                    value=s.spec_num_accepted_tokens / s.spec_num_draft_tokens)
            yield GaugeMetricFamily("fastllm_spec_decode_mean_accepted_length",
                                    "Tokens a verification gives a request: accepted drafts + the target's own",
                                    value=1 + s.spec_num_accepted_tokens / s.spec_num_drafts)
