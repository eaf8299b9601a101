"""Prometheus metrics of a splitserve deployment (one registry per frontend process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.kvtransfer.poll_reply import PollReply

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
        self.queue_depth = Gauge("splitserve_queue_depth", "Waiting requests per pool", ["pool"], registry=r)
        self.running = Gauge("splitserve_running_requests", "Running requests per pool", ["pool"], registry=r)
        self.frontend_inflight = Gauge(
            "splitserve_frontend_inflight_requests",
            "Requests admitted by the frontend and not yet finished",
            registry=r,
        )
        self.kv_usage = Gauge(
            "splitserve_kv_block_usage", "Fraction of KV blocks in use", ["pool", "replica"], registry=r
        )
        self.prefix_hit_tokens = Counter(
            "splitserve_prefix_cache_hit_tokens", "Prompt tokens served from a prefix cache", registry=r
        )
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Tokens generated", registry=r)
        self.transfer_bytes = Counter("splitserve_kv_transfer_bytes", "KV bytes moved prefill->decode", registry=r)
        self.transfer_seconds = Counter(
            "splitserve_kv_transfer_seconds", "Seconds spent moving KV prefill->decode", registry=r
        )
        self.router_decisions = Counter(
            "splitserve_router_decisions", "Router decisions by reason", ["reason"], registry=r
        )
        self.replicas = Gauge("splitserve_replicas", "Live replicas per pool", ["pool"], registry=r)
        # Every family labelled by replica: forget_replica removes a replica's series from each.
        self.per_replica = (self.kv_usage,)
        self.scaling_decisions = Counter(
            "splitserve_scaling_decisions", "Autoscaler decisions", ["pool", "decision"], registry=r
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
        self.replica_grammar = {
            key: Counter(f"splitserve_{key}", help_text, ["pool"], registry=r)
            for key, help_text in (
                ("grammar_compile_seconds_replica", "Seconds replicas spent compiling grammars"),
                ("grammar_mask_seconds", "Seconds decode steps spent waiting for and applying grammar masks"),
                ("grammar_mask_steps", "Engine steps that applied grammar masks"),
            )
        }
        self._last_transfer: dict[str, tuple[float, float]] = {}
        self._last_grammar: dict[tuple[str, str], float] = {}

    def observe_poll(self, pool: str, replica_id: str, poll: PollReply) -> None:
        """Fold one replica poll into the gauges and the transfer counters."""
        self.kv_usage.labels(pool, replica_id).set(poll.engine.kv_usage)
        for key, counter in self.replica_grammar.items():
            stat = key.removesuffix("_replica")
            value = getattr(poll.engine, stat)
            previous = self._last_grammar.get((replica_id, stat), 0.0)
            counter.labels(pool).inc(max(value - previous, 0))
            self._last_grammar[(replica_id, stat)] = value
        if pool == "decode":
            transfer = poll.transfer
            prev_bytes, prev_secs = self._last_transfer.get(replica_id, (0.0, 0.0))
            self.transfer_bytes.inc(max(transfer.num_bytes - prev_bytes, 0))
            self.transfer_seconds.inc(max(transfer.seconds - prev_secs, 0))
            self._last_transfer[replica_id] = (transfer.num_bytes, transfer.seconds)

    def set_pool_totals(self, pool: str, num_replicas: int, num_waiting: int, num_running: int) -> None:
        self.replicas.labels(pool).set(num_replicas)
        self.queue_depth.labels(pool).set(num_waiting)
        self.running.labels(pool).set(num_running)

    def forget_replica(self, pool: str, replica_id: str) -> None:
        """A replica left: stop exporting its series (they would show it forever, frozen)."""
        for family in self.per_replica:
            try:
                family.remove(pool, replica_id)
            except KeyError:
                pass
        self._last_transfer.pop(replica_id, None)
        for key in [k for k in self._last_grammar if k[0] == replica_id]:
            del self._last_grammar[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)
