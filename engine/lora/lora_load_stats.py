"""Adapter loads and evictions per tier since start, torch-free: "host" is an adapter read
from its directory into the host cache (and dropped from it), "device" one copied from the
host into a device slot (and evicted from it). The last seconds of each tier's loads are kept
for the controller's histogram (cluster/control/lora_metrics.py), which takes the loads it
has not seen yet by their count."""

from __future__ import annotations

from collections import deque

TIERS = ("device", "host")
# Recent load durations kept per tier: the controller polls far more often than this many
# loads happen; loads it misses still count in lora_loads.
RECENT_LOADS = 256


class LoraLoadStats:
    def __init__(self) -> None:
        self.loads = dict.fromkeys(TIERS, 0)
        self.evictions = dict.fromkeys(TIERS, 0)
        self.load_seconds = {tier: 0.0 for tier in TIERS}
        self.recent_seconds: dict[str, deque[float]] = {tier: deque(maxlen=RECENT_LOADS) for tier in TIERS}

    def loaded(self, tier: str, seconds: float) -> None:
        self.loads[tier] += 1
        self.load_seconds[tier] += seconds
        self.recent_seconds[tier].append(seconds)

    def evicted(self, tier: str) -> None:
        self.evictions[tier] += 1

    def stats(self) -> dict:
        """EngineStats' lora_loads, lora_evictions, lora_load_seconds (totals by tier) and
        lora_recent_load_seconds (the last loads' seconds by tier, oldest first)."""
        return {
            "lora_loads": dict(self.loads),
            "lora_evictions": dict(self.evictions),
            "lora_load_seconds": dict(self.load_seconds),
            "lora_recent_load_seconds": {tier: list(seconds) for tier, seconds in self.recent_seconds.items()},
        }
