"""Prometheus metrics of one ingress replica: its requests, latencies and tokens (one
registry per ingress process). Pool series (replicas, queues, KV usage, preemptions,
transfers, grammar work, scaling) are the controller's (cluster/control/pool_metrics.py);
/metrics renders both, merged over every ingress (cluster/control/metrics_aggregator.py).

Every family carries a `model_name` label, as vLLM's do, so one Prometheus can tell several
deployments apart and dashboards written against vLLM's labels filter the same way.
docs/METRICS.md maps each vLLM metric to its splitserve counterpart."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from splitserve.cluster.metric_families import LATENCY_BUCKETS, ModelFamilies

# Tokens per request (vLLM's request_prompt_tokens / request_generation_tokens buckets: 1-2-5).
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        f = ModelFamilies(self.registry, model_name)
        self.ttft = f.histogram("splitserve_ttft_seconds", "Time to first token")
        self.itl = f.histogram("splitserve_itl_seconds", "Inter-token latency")
        self.e2e = f.histogram("splitserve_e2e_seconds", "End-to-end request latency")
        self.first_token_stage = f.labeled_histogram(
            "splitserve_first_token_stage_seconds",
            "A request's first token by stage: ingress, routing, prefill_queue, prefill_compute, handoff, "
            "decode_admission, relay (cluster/frontend/first_token_stages.py)",
            "stage",
        )
        self.queue_time = f.histogram(
            "splitserve_request_queue_time_seconds", "Time a request's prompt waited in an engine queue"
        )
        self.request_prompt_tokens = f.histogram(
            "splitserve_request_prompt_tokens", "Prompt tokens per finished request", TOKEN_BUCKETS
        )
        self.request_generation_tokens = f.histogram(
            "splitserve_request_generation_tokens", "Generated tokens per finished request", TOKEN_BUCKETS
        )
        self.requests = f.counter(
            "splitserve_requests", "Finished requests by status: ok, cancelled, or the error kind", "status"
        )
        self.request_success = f.counter(
            "splitserve_request_success", "Requests that finished generating, by finish reason", "finished_reason"
        )
        self.frontend_inflight = f.gauge(
            "splitserve_frontend_inflight_requests", "Requests admitted by the frontend and not yet finished"
        )
        self.prefix_query_tokens = f.counter(
            "splitserve_prefix_cache_query_tokens", "Prompt tokens looked up in a prefix cache"
        )
        self.prefix_hit_tokens = f.counter(
            "splitserve_prefix_cache_hit_tokens", "Prompt tokens served from a prefix cache"
        )
        self.prompt_tokens = f.counter("splitserve_prompt_tokens", "Prompt tokens received")
        self.generation_tokens = f.counter("splitserve_generation_tokens", "Tokens generated")
        self.router_decisions = f.counter("splitserve_router_decisions", "Router decisions by reason", "reason")
        # The adapter-hit share: hits / routes, per pool (routing/adapter_affinity.py).
        self.router_lora_routes = f.counter(
            "splitserve_router_lora_routes", "LoRA requests routed, by the pool of the replica picked", "pool"
        )
        self.router_lora_adapter_hits = f.counter(
            "splitserve_router_lora_adapter_hits",
            "LoRA requests routed to a replica whose last report had their adapter in its device slots",
            "pool",
        )
        self.lora_requests = f.counter(
            "splitserve_lora_requests", "Requests for a LoRA adapter, by the adapter's name", "adapter"
        )
        self.structured_requests = f.counter(
            "splitserve_structured_requests", "Requests with a structured-output constraint", "kind"
        )
        self.migrations = MigrationMetrics(f)
        self.grammar_compile = f.histogram(
            "splitserve_grammar_compile_seconds",
            "Frontend grammar compile time per structured request (cache hits included)",
            buckets=(0.0001, 0.0005, 0.001, 0.005, *LATENCY_BUCKETS[1:]),
        )

    def observe_finished(self, finish_reason: str | None, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A request's last chunk arrived: count it by finish reason, record its sizes."""
        self.request_success.labels(finish_reason or "stop").inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)

    def render(self) -> bytes:
        """This process's samples only (the merged view: MetricsAggregator)."""
        return generate_latest(self.registry)


class MigrationMetrics:
    """Streams moved to another decode replica mid-stream, the tokens they carried, the gap
    each move left in the client's stream, the tokens each continuation computed again, and
    the moves refused (the dispatcher's MigrationObserver)."""

    def __init__(self, f: ModelFamilies):
        self.total = f.counter(
            "splitserve_migrations",
            "Streams moved to another replica after theirs failed mid-stream, by its pool and the failure",
            "pool",
            "reason",
        )
        self.tokens = f.counter(
            "splitserve_migrated_tokens", "Output tokens a moved stream carried into its continuation's prompt"
        )
        self.refusals = f.counter(
            "splitserve_migrations_refused",
            "Mid-stream replica failures whose stream was not moved: disabled, max_attempts, no_replica",
            "reason",
        )

        self.gaps = f.histogram(
            "splitserve_migration_gap_seconds",
            "Per move, the client's wait from the last token before its replica failed to the first after",
        )
        self.recomputed_tokens = f.histogram(
            "splitserve_migration_recomputed_tokens",
            "Per move, the continuation's prompt tokens its new replica computed again "
            "(not found in a prefix cache or the host KV tier)",
            TOKEN_BUCKETS,
        )

    def gap(self, seconds: float) -> None:
        self.gaps.observe(seconds)

    def recomputed(self, num_tokens: int) -> None:
        self.recomputed_tokens.observe(num_tokens)

    def moved(self, pool: str, reason: str, num_tokens: int) -> None:
        self.total.labels(pool, reason).inc()
        self.tokens.inc(num_tokens)

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()


class RouterViewCollector(Collector):
    """splitserve_router_indexed_blocks{pool, ingress}: the block hashes this ingress's router
    indexes per pool, read at collect time. Every ingress follows the same KV event streams,
    so their series should agree; one that trails the others is lagging those streams (and
    routes some prefixes away from the replica that holds them). With host_blocks (the
    replicas have a host KV tier) the series split by a `tier` label: device and host."""

    def __init__(
        self,
        model_name: str,
        ingress_id: str,
        indexed_blocks: Callable[[], dict[str, int]],
        host_blocks: Callable[[], dict[str, int]] | None = None,
    ):
        self.model_name, self.ingress_id, self.indexed_blocks = model_name, ingress_id, indexed_blocks
        self.host_blocks = host_blocks

    def collect(self):
        tiered = self.host_blocks is not None
        family = GaugeMetricFamily(
            "splitserve_router_indexed_blocks",
            "Block hashes this ingress's router indexes, per pool" + (" and KV tier" if tiered else ""),
            labels=["model_name", "pool", "ingress"] + (["tier"] if tiered else []),
        )
        for pool, num_hashes in self.indexed_blocks().items():
            family.add_metric([self.model_name, pool, self.ingress_id] + (["device"] if tiered else []), num_hashes)
        if tiered:
            for pool, num_hashes in self.host_blocks().items():
                family.add_metric([self.model_name, pool, self.ingress_id, "host"], num_hashes)
        yield family


class GrammarCheckCollector(Collector):
    """The ingress's isolated grammar check (engine/structured_output/isolated_grammar_checker.py), read
    at collect time: splitserve_grammar_verdict_cache_entries{ingress} (bounded by
    grammar.cache_size), and counters of cache hits and misses, refusals, and compile workers
    lost to a crash or a timeout."""

    def __init__(self, model_name: str, ingress_id: str, stats: Callable[[], dict[str, float]]):
        self.model_name, self.ingress_id, self.stats = model_name, ingress_id, stats

    def collect(self):
        stats = self.stats()
        labels = ["model_name", "ingress"]
        entries = GaugeMetricFamily(
            "splitserve_grammar_verdict_cache_entries", "Grammar verdicts this ingress caches now", labels=labels
        )
        entries.add_metric([self.model_name, self.ingress_id], stats["entries"])
        yield entries
        for key, help_text in (
            ("hits", "Grammar checks answered from the verdict cache"),
            ("misses", "Grammar checks that compiled in an isolated worker"),
            ("refused", "Grammars the isolated compile refused (invalid, unsatisfiable, crashed, timed out)"),
            ("worker_losses", "Isolated grammar compile workers lost to a crash, the memory cap or a timeout"),
        ):
            family = CounterMetricFamily(f"splitserve_grammar_check_{key}", help_text, labels=labels)
            family.add_metric([self.model_name, self.ingress_id], stats[key])
            yield family
