"""LoRA adapter tier series, folded from the controller's replica probes (EngineStats.lora_*):
adapters loaded and evicted per pool and tier ("host": read from the adapter's directory into
a replica's host cache and dropped from it; "device": copied from the host into a device slot
and evicted from it), and the seconds of each load as a histogram by tier (a load from disk
costs host + device). Nothing is exported for a replica that serves no adapters."""

from __future__ import annotations

from splitserve.proto.messages.engine_stats import EngineStats

# Adapter loads take milliseconds (a host -> device copy) to seconds (a large adapter read).
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoraMetrics:
    def __init__(self, counter, labeled_histogram):
        self.loads = counter(
            "splitserve_lora_loads", "LoRA adapters loaded into a tier (device or host)", "pool", "tier"
        )
        self.evictions = counter(
            "splitserve_lora_evictions", "LoRA adapters evicted from a tier (device or host)", "pool", "tier"
        )
        self.load_seconds = labeled_histogram(
            "splitserve_lora_load_seconds",
            "Seconds of one LoRA adapter load, by tier",
            "pool",
            "tier",
            buckets=LOAD_BUCKETS,
        )
        self._last: dict[tuple[str, str, str], int] = {}  # (replica, stat, tier) -> last count seen

    def observe(self, pool: str, replica_id: str, stats: EngineStats) -> None:
        if not stats.lora_slots:
            return
        for tier, count in stats.lora_evictions.items():
            self.evictions.labels(pool, tier).inc(self._delta(replica_id, "evictions", tier, count))
        for tier, count in stats.lora_loads.items():
            new = self._delta(replica_id, "loads", tier, count)
            self.loads.labels(pool, tier).inc(new)
            # The loads since the last probe are the newest of the recent ones (any older than
            # those the replica keeps are counted above, not timed).
            recent = stats.lora_recent_load_seconds.get(tier, [])
            for seconds in recent[len(recent) - min(new, len(recent)) :]:
                self.load_seconds.labels(pool, tier).observe(seconds)

    def _delta(self, replica_id: str, stat: str, tier: str, value: int) -> int:
        previous = self._last.get((replica_id, stat, tier), 0)
        self._last[(replica_id, stat, tier)] = value
        return max(value - previous, 0)

    def forget_replica(self, replica_id: str) -> None:
        for key in [k for k in self._last if k[0] == replica_id]:
            del self._last[key]
