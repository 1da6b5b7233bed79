"""Prometheus metrics of one server (vLLM's names, with the ``portlayer:`` prefix).

Each server owns its own ``CollectorRegistry`` (no process-wide globals, so two servers in
one process, as in the tests, count separately). Gauges read the engine when scraped.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)  # fmt: skip


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, async_engine: Any) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("portlayer:http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)  # fmt: skip
        self.request_success = Counter("portlayer:request_success", "Finished generation choices by finish reason",
                                       ["finished_reason"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("portlayer:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("portlayer:generation_tokens", "Generated tokens", registry=r)
        self.step_seconds = Histogram("portlayer:engine_step_seconds", "Wall time of one engine step",
                                      buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.ttft = Histogram("portlayer:time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("portlayer:inter_token_latency_seconds", "Time between two outputs of one request",
                             buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("portlayer:e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        stats = async_engine.engine_stats  # the engine's numbers, read where the engine runs (thread or process)
        Gauge("portlayer:num_requests_running", "Sequences the scheduler is running",
              registry=r).set_function(lambda: stats()["running"])  # fmt: skip
        Gauge("portlayer:num_requests_waiting", "Sequences waiting for admission",
              registry=r).set_function(lambda: stats()["waiting"])  # fmt: skip
        Gauge("portlayer:num_requests_in_flight", "Engine requests the server holds (running, waiting, queued)",
              registry=r).set_function(lambda: async_engine.num_in_flight)  # fmt: skip
        Gauge("portlayer:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)",
              registry=r).set_function(lambda: _usage(stats()))  # fmt: skip

    def observe_step(self, seconds: float, num_outputs: int) -> None:
        self.step_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _usage(stats: dict[str, Any]) -> float:
    return 1.0 - stats["free_blocks"] / max(stats["num_blocks"], 1)
