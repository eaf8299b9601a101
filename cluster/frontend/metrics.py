"""Prometheus metrics of a splitserve deployment (one registry per frontend process).

Every family carries a `model_name` label, as vLLM's do, so one Prometheus can tell several
deployments apart and dashboards written against vLLM's labels filter the same way.
docs/METRICS.md maps each vLLM metric to its splitserve counterpart."""

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
# Tokens per request (vLLM's request_prompt_tokens / request_generation_tokens buckets: 1-2-5).
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


class _ModelLabeled:
    """A labelled metric whose model_name label is bound once: .labels(*rest) fills the others."""

    def __init__(self, metric, model_name: str):
        self.metric = metric
        self.model_name = model_name

    def labels(self, *values: str):
        return self.metric.labels(self.model_name, *values)

    def remove(self, *values: str) -> None:
        self.metric.remove(self.model_name, *values)

    def describe(self):
        return self.metric.describe()


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, *labels: str):
            return self._bind(Counter(name, doc, ["model_name", *labels], registry=r), labels)

        def gauge(name: str, doc: str, *labels: str):
            return self._bind(Gauge(name, doc, ["model_name", *labels], registry=r), labels)

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, ["model_name"], registry=r, buckets=buckets).labels(model_name)

        self.ttft = histogram("splitserve_ttft_seconds", "Time to first token")
        self.itl = histogram("splitserve_itl_seconds", "Inter-token latency")
        self.e2e = histogram("splitserve_e2e_seconds", "End-to-end request latency")
        self.queue_time = histogram(
            "splitserve_request_queue_time_seconds", "Time a request's prompt waited in an engine queue"
        )
        self.request_prompt_tokens = histogram(
            "splitserve_request_prompt_tokens", "Prompt tokens per finished request", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "splitserve_request_generation_tokens", "Generated tokens per finished request", TOKEN_BUCKETS
        )
        self.requests = counter(
            "splitserve_requests", "Finished requests by status: ok, cancelled, or the error kind", "status"
        )
        self.request_success = counter(
            "splitserve_request_success", "Requests that finished generating, by finish reason", "finished_reason"
        )
        self.queue_depth = gauge("splitserve_queue_depth", "Waiting requests per pool", "pool")
        self.running = gauge("splitserve_running_requests", "Running requests per pool", "pool")
        self.frontend_inflight = gauge(
            "splitserve_frontend_inflight_requests", "Requests admitted by the frontend and not yet finished"
        )
        self.kv_usage = gauge("splitserve_kv_block_usage", "Fraction of KV blocks in use", "pool", "replica")
        self.prefix_query_tokens = counter(
            "splitserve_prefix_cache_query_tokens", "Prompt tokens looked up in a prefix cache"
        )
        self.prefix_hit_tokens = counter(
            "splitserve_prefix_cache_hit_tokens", "Prompt tokens served from a prefix cache"
        )
        self.prompt_tokens = counter("splitserve_prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("splitserve_generation_tokens", "Tokens generated")
        self.preemptions = counter("splitserve_num_preemptions", "Requests preempted by an engine", "pool")
        self.transfer_bytes = counter("splitserve_kv_transfer_bytes", "KV bytes moved prefill->decode")
        self.transfer_seconds = counter("splitserve_kv_transfer_seconds", "Seconds spent moving KV prefill->decode")
        self.router_decisions = counter("splitserve_router_decisions", "Router decisions by reason", "reason")
        self.replicas = gauge("splitserve_replicas", "Live replicas per pool", "pool")
        self.scaling_decisions = counter("splitserve_scaling_decisions", "Autoscaler decisions", "pool", "decision")
        # Every family labelled by replica: forget_replica removes a replica's series from each.
        self.per_replica = (self.kv_usage,)
        self.structured_requests = counter(
            "splitserve_structured_requests", "Requests with a structured-output constraint", "kind"
        )
        self.grammar_compile = histogram(
            "splitserve_grammar_compile_seconds",
            "Frontend grammar compile time per structured request (cache hits included)",
            buckets=(0.0001, 0.0005, 0.001, 0.005, *LATENCY_BUCKETS[1:]),
        )
        self.replica_grammar = {
            key: counter(f"splitserve_{key}", help_text, "pool")
            for key, help_text in (
                ("grammar_compile_seconds_replica", "Seconds replicas spent compiling grammars"),
                ("grammar_mask_seconds", "Seconds decode steps spent waiting for and applying grammar masks"),
                ("grammar_mask_steps", "Engine steps that applied grammar masks"),
            )
        }
        self._last_transfer: dict[str, tuple[float, float]] = {}
        self._last_preemptions: dict[tuple[str, str], float] = {}
        self._last_grammar: dict[tuple[str, str], float] = {}

    def _bind(self, metric, labels: tuple[str, ...]):
        return _ModelLabeled(metric, self.model_name) if labels else metric.labels(self.model_name)

    def observe_poll(self, pool: str, replica_id: str, poll: PollReply) -> None:
        """Fold one replica poll into the gauges and the cumulative counters."""
        self.kv_usage.labels(pool, replica_id).set(poll.engine.kv_usage)
        prev = self._last_preemptions.get((pool, replica_id), 0)
        self.preemptions.labels(pool).inc(max(poll.engine.num_preemptions - prev, 0))
        self._last_preemptions[(pool, replica_id)] = poll.engine.num_preemptions
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

    def observe_finished(self, finish_reason: str | None, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A request's last chunk arrived: count it by finish reason, record its sizes."""
        self.request_success.labels(finish_reason or "stop").inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)

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
        self._last_preemptions.pop((pool, replica_id), None)
        for key in [k for k in self._last_grammar if k[0] == replica_id]:
            del self._last_grammar[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)
