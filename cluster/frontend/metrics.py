"""Prometheus metrics of one ingress replica: its requests, latencies and tokens (one
registry per ingress process). Pool series (replicas, KV usage, transfers, scaling) are the
controller's (cluster/control/pool_metrics.py); /metrics renders both, merged over every
ingress (cluster/control/metrics_aggregator.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("splitserve_ttft_seconds", "Time to first token", registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("splitserve_itl_seconds", "Inter-token latency", registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram(
            "splitserve_e2e_seconds", "End-to-end request latency", registry=r, buckets=LATENCY_BUCKETS
        )
        self.requests = Counter(
            "splitserve_requests",
            "Finished requests by status: ok, cancelled, or the error kind",
            ["status"],
            registry=r,
        )
        self.frontend_inflight = Gauge(
            "splitserve_frontend_inflight_requests",
            "Requests admitted by the frontend and not yet finished",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "splitserve_prefix_cache_hit_tokens", "Prompt tokens served from a prefix cache", registry=r
        )
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Tokens generated", registry=r)
        self.router_decisions = Counter(
            "splitserve_router_decisions", "Router decisions by reason", ["reason"], registry=r
        )
        self.structured_requests = Counter(
            "splitserve_structured_requests", "Requests with a structured-output constraint", ["kind"], registry=r
        )
        self.grammar_compile = Histogram(
            "splitserve_grammar_compile_seconds",
            "Frontend grammar compile time per structured request (cache hits included)",
            registry=r,
            buckets=(0.0001, 0.0005, 0.001, 0.005, *LATENCY_BUCKETS[1:]),
        )

    def render(self) -> bytes:
        """This process's samples only (the merged view: MetricsAggregator)."""
        return generate_latest(self.registry)
