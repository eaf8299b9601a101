"""PoolMetrics: the Prometheus series the controller owns -- one per pool or per replica,
measured once (by the controller's probes), not once per ingress: replica counts, queue
depth, running requests, KV usage, blocks and bytes per block per replica, preemptions, KV moved prefill -> decode, the
replicas' grammar work, speculative decoding, host KV tier and LoRA adapter tiers, and the autoscaler's decisions. Labelled `model_name` like the
ingresses' series. A replica that leaves has its series removed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from splitserve.cluster.control.host_tier_metrics import HostTierMetrics
from splitserve.cluster.control.lora_metrics import LoraMetrics
from splitserve.cluster.control.spec_decode_metrics import SpecDecodeMetrics
from splitserve.cluster.control.step_timing_metrics import StepTimingMetrics
from splitserve.cluster.metric_families import ModelFamilies
from splitserve.proto.messages.poll_reply import PollReply


class PoolMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, batch_priority: int = 100):
        """batch_priority: preempted requests of this priority or above count as class batch."""
        self.model_name = model_name
        self.batch_priority = batch_priority
        self.registry = registry or CollectorRegistry()
        f = ModelFamilies(self.registry, model_name)
        self.replicas = f.gauge("splitserve_replicas", "Live replicas per pool", "pool")
        self.queue_depth = f.gauge("splitserve_queue_depth", "Waiting requests per pool", "pool")
        self.running = f.gauge("splitserve_running_requests", "Running requests per pool", "pool")
        self.kv_usage = f.gauge("splitserve_kv_block_usage", "Fraction of KV blocks in use", "pool", "replica")
        self.kv_blocks = f.gauge("splitserve_kv_cache_blocks", "KV blocks in a replica's cache", "pool", "replica")
        self.kv_block_bytes = f.gauge(
            "splitserve_kv_cache_block_bytes", "Bytes of one KV block, all layers, scales included", "pool", "replica"
        )
        self.preemptions = f.counter("splitserve_num_preemptions", "Requests preempted by an engine", "pool")
        self.preemptions_by_class = f.counter(
            "splitserve_preemptions_by_class", "Requests preempted by an engine, by priority class", "pool", "class"
        )
        self.transfer_bytes = f.counter("splitserve_kv_transfer_bytes", "KV bytes moved prefill->decode")
        self.transfer_seconds = f.counter("splitserve_kv_transfer_seconds", "Seconds spent moving KV prefill->decode")
        self.scaling_decisions = f.counter("splitserve_scaling_decisions", "Autoscaler decisions", "pool", "decision")
        self.planner_target_replicas = f.gauge(
            "splitserve_planner_target_replicas", "Replicas the sla autoscaling policy plans per pool", "pool"
        )
        self.planner_predicted_ttft = f.gauge(
            "splitserve_planner_predicted_ttft_seconds", "TTFT the sla policy predicts for its plan, at its percentile"
        )
        self.planner_predicted_itl = f.gauge(
            "splitserve_planner_predicted_itl_seconds", "ITL the sla policy predicts for its plan, at its percentile"
        )
        self.replica_grammar = {
            key: f.counter(f"splitserve_{key}", help_text, "pool")
            for key, help_text in (
                ("grammar_compile_seconds_replica", "Seconds replicas spent compiling grammars"),
                ("grammar_mask_seconds", "Seconds decode steps spent waiting for and applying grammar masks"),
                ("grammar_mask_steps", "Engine steps that applied grammar masks"),
                ("grammar_compiles_replica", "Grammars replicas compiled (grammar cache misses)"),
                ("grammar_cache_hits_replica", "Grammar cache hits in the replicas"),
            )
        }
        self.grammar_cache_entries = f.gauge(
            "splitserve_grammar_cache_entries_replica", "Compiled grammars a replica caches now", "pool", "replica"
        )
        self.lora_slots_used = f.gauge(
            "splitserve_lora_slots_in_use",
            "LoRA adapter slots holding an adapter on a replica's device",
            "pool",
            "replica",
        )
        self.lora = LoraMetrics(f.counter, f.labeled_histogram)
        self.spec_decode = SpecDecodeMetrics(f.counter, f.gauge)
        self.host_tier = HostTierMetrics(f.counter, f.gauge)
        self.step_timing = StepTimingMetrics(f.counter, f.gauge)
        # Every family labelled by replica: forget_replica removes a replica's series from each.
        self.per_replica = (
            self.kv_usage,
            self.kv_blocks,
            self.kv_block_bytes,
            self.grammar_cache_entries,
            self.lora_slots_used,
        )
        self._last_transfer: dict[str, tuple[float, float]] = {}
        self._last_preemptions: dict[tuple, float] = {}  # (pool, replica[, class]) -> last total
        self._last_grammar: dict[tuple[str, str], float] = {}

    def observe_poll(self, pool: str, replica_id: str, poll: PollReply) -> None:
        """Fold one replica probe into the gauges and the cumulative counters."""
        self.kv_usage.labels(pool, replica_id).set(poll.engine.kv_usage)
        self.kv_blocks.labels(pool, replica_id).set(poll.engine.num_blocks)
        self.kv_block_bytes.labels(pool, replica_id).set(poll.engine.kv_block_bytes)
        self.grammar_cache_entries.labels(pool, replica_id).set(poll.engine.grammar_cache_entries)
        if poll.engine.lora_slots:  # only replicas that serve LoRA adapters
            self.lora_slots_used.labels(pool, replica_id).set(poll.engine.lora_slots_used)
        prev = self._last_preemptions.get((pool, replica_id), 0)
        self.preemptions.labels(pool).inc(max(poll.engine.num_preemptions - prev, 0))
        self._last_preemptions[(pool, replica_id)] = poll.engine.num_preemptions
        by_class = {"interactive": 0, "batch": 0}
        for priority, count in poll.engine.preemptions_by_priority.items():
            by_class["batch" if priority >= self.batch_priority else "interactive"] += count
        for name, count in by_class.items():
            prev = self._last_preemptions.get((pool, replica_id, name), 0)
            self.preemptions_by_class.labels(pool, name).inc(max(count - prev, 0))
            self._last_preemptions[(pool, replica_id, name)] = count
        for key, counter in self.replica_grammar.items():
            stat = key.removesuffix("_replica")
            value = getattr(poll.engine, stat)
            previous = self._last_grammar.get((replica_id, stat), 0.0)
            counter.labels(pool).inc(max(value - previous, 0))
            self._last_grammar[(replica_id, stat)] = value
        self.lora.observe(pool, replica_id, poll.engine)
        self.spec_decode.observe(pool, replica_id, poll.engine)
        self.host_tier.observe(pool, replica_id, poll.engine)
        self.step_timing.observe(pool, replica_id, poll.engine)
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
        for key in [k for k in self._last_preemptions if k[:2] == (pool, replica_id)]:
            del self._last_preemptions[key]
        for key in [k for k in self._last_grammar if k[0] == replica_id]:
            del self._last_grammar[key]
        self.lora.forget_replica(replica_id)
        self.spec_decode.forget_replica(replica_id)
        self.host_tier.forget_replica(pool, replica_id)
        self.step_timing.forget_replica(replica_id)

    def render(self) -> bytes:
        """These series only (the merged view: MetricsAggregator)."""
        return generate_latest(self.registry)
