"""Host KV tier pool series, folded from the controller's replica probes (EngineStats.host_*).

Counters per pool: blocks stored to the host tier (device evictions kept), loaded back from it
(instead of recomputed), evicted from it (LRU, for room); prompt tokens served by tier
(device = prefix-cache hits on the device, host = hits loaded from host memory) and computed,
so hit rates by tier are ratios of counters; host loads and their seconds (mean load latency =
seconds / loads). Gauge per pool and replica: the host tier's usage. Nothing is exported for a
replica without a host tier (kv_offloading_size 0).
"""

from __future__ import annotations

from splitserve.proto.messages.engine_stats import EngineStats

_COUNTERS = (
    ("splitserve_kv_host_stored_blocks", "host_stored_blocks", "KV blocks written to the host tier on device eviction"),
    ("splitserve_kv_host_loaded_blocks", "host_loaded_blocks", "KV blocks loaded back from the host tier"),
    ("splitserve_kv_host_evicted_blocks", "host_evicted_blocks", "KV blocks dropped from the host tier (LRU)"),
    ("splitserve_kv_host_loads", "host_loads", "Loads from the host tier (one per admitted prompt that hit it)"),
    ("splitserve_kv_host_load_seconds", "host_load_seconds", "Seconds spent loading blocks from the host tier"),
    ("splitserve_kv_host_save_seconds", "host_save_seconds", "Seconds spent writing evicted blocks to the host tier"),
)


class HostTierMetrics:
    def __init__(self, counter, gauge):
        self.counters = {name: counter(name, doc, "pool") for name, _, doc in _COUNTERS}
        self.prompt_tokens = counter(
            "splitserve_kv_prompt_tokens_by_tier",
            "Prompt tokens by where their KV came from: device or host prefix-cache hits, or computed",
            "pool",
            "tier",
        )
        self.usage = gauge(
            "splitserve_kv_host_block_usage", "Fraction of host-tier KV blocks in use", "pool", "replica"
        )
        self._last: dict[tuple[str, str], float] = {}  # (replica, stat) -> last value seen

    def observe(self, pool: str, replica_id: str, stats: EngineStats) -> None:
        if not stats.host_num_blocks:
            return
        for name, stat, _ in _COUNTERS:
            self.counters[name].labels(pool).inc(self._delta(replica_id, stat, getattr(stats, stat)))
        tiers = (
            ("device", stats.num_prefix_hit_tokens - stats.host_hit_tokens),
            ("host", stats.host_hit_tokens),
            ("computed", stats.num_computed_prompt_tokens),
        )
        for tier, value in tiers:
            self.prompt_tokens.labels(pool, tier).inc(self._delta(replica_id, f"tokens_{tier}", value))
        self.usage.labels(pool, replica_id).set(stats.host_num_used_blocks / stats.host_num_blocks)

    def _delta(self, replica_id: str, stat: str, value: float) -> float:
        previous = self._last.get((replica_id, stat), 0.0)
        self._last[(replica_id, stat)] = value
        return max(value - previous, 0.0)

    def forget_replica(self, pool: str, replica_id: str) -> None:
        for key in [k for k in self._last if k[0] == replica_id]:
            del self._last[key]
        try:
            self.usage.remove(pool, replica_id)
        except KeyError:
            pass
