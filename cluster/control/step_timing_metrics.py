"""Engine step timing pool series, folded from the controller's replica probes (EngineStats'
step timing, engine/step_timing.py): counters per pool of engine steps, seconds in forward
passes, seconds of host work around them, and the part of that host work the forward passes
waited for; a gauge per pool of the overlap achieved since the replicas started,
1 - exposed / host (0 with the synchronous step, up to 1 when async scheduling hides it all).
"""

from __future__ import annotations

from splitserve.proto.messages.engine_stats import EngineStats

_COUNTERS = (
    ("engine_steps", "num_timed_steps", "Engine steps run"),
    ("engine_forward_seconds", "step_forward_seconds", "Seconds engine steps spent in forward passes"),
    ("engine_host_seconds", "step_host_seconds", "Seconds of engine host work around the forward passes"),
    (
        "engine_exposed_host_seconds",
        "step_exposed_host_seconds",
        "Seconds of engine host work the forward passes waited for (not overlapped)",
    ),
)


class StepTimingMetrics:
    def __init__(self, counter, gauge):
        self.counters = {name: counter(f"splitserve_{name}", doc, "pool") for name, _, doc in _COUNTERS}
        self.overlap = gauge(
            "splitserve_engine_host_overlap", "Share of engine host work overlapped with forward passes", "pool"
        )
        self._last: dict[tuple[str, str], float] = {}  # (replica, stat) -> last value seen
        self._totals: dict[tuple[str, str], float] = {}  # (pool, stat) -> sum of increments

    def observe(self, pool: str, replica_id: str, stats: EngineStats) -> None:
        for name, stat, _ in _COUNTERS:
            value = getattr(stats, stat)
            previous = self._last.get((replica_id, stat), 0.0)
            self._last[(replica_id, stat)] = value
            delta = max(value - previous, 0.0)
            self.counters[name].labels(pool).inc(delta)
            self._totals[(pool, stat)] = self._totals.get((pool, stat), 0.0) + delta
        host = self._totals[(pool, "step_host_seconds")]
        if host > 0:
            exposed = self._totals[(pool, "step_exposed_host_seconds")]
            self.overlap.labels(pool).set(max(0.0, 1.0 - exposed / host))

    def forget_replica(self, replica_id: str) -> None:
        for key in [k for k in self._last if k[0] == replica_id]:
            del self._last[key]
