"""Speculative-decoding pool series, folded from the controller's replica probes (EngineStats.spec_*).

Counters per pool and method: drafts verified, draft tokens proposed, accepted, and tokens
emitted by verify steps; per pool and k, the decoding sequence-steps the policy chose k for
(k = 0: no speculation) -- a histogram of the chosen k, one counter per bucket, because
replicas report counts per k, not samples. Gauges per pool and method, over everything since
the replicas started: the acceptance rate (accepted / proposed) and the mean accepted length
(accepted / drafts). Names follow vLLM's spec_decode family (docs/METRICS.md).
"""

from __future__ import annotations

from splitserve.proto.messages.engine_stats import EngineStats

_COUNTERS = (
    ("num_drafts", "spec_num_drafts", "Speculative drafts verified"),
    ("num_draft_tokens", "spec_proposed_tokens", "Draft tokens proposed and verified"),
    ("num_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted"),
    ("num_emitted_tokens", "spec_emitted_tokens", "Tokens emitted by verify steps (accepted + one each)"),
)


class SpecDecodeMetrics:
    def __init__(self, counter, gauge):
        self.counters = {
            name: counter(f"splitserve_spec_decode_{name}", doc, "pool", "method") for name, _, doc in _COUNTERS
        }
        self.chosen_k = counter(
            "splitserve_spec_decode_chosen_k",
            "Decoding sequence-steps by the draft length k the policy chose",
            "pool",
            "k",
        )
        self.acceptance_rate = gauge(
            "splitserve_spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start", "pool", "method"
        )
        self.mean_accepted_length = gauge(
            "splitserve_spec_decode_mean_accepted_length",
            "Accepted draft tokens per draft since start",
            "pool",
            "method",
        )
        self._last: dict[tuple[str, str], float] = {}  # (replica, stat) -> last value seen
        self._totals: dict[tuple[str, str, str], float] = {}  # (pool, method, stat) -> sum of increments

    def observe(self, pool: str, replica_id: str, stats: EngineStats) -> None:
        if stats.spec_method == "none":
            return
        method = stats.spec_method
        for name, stat, _ in _COUNTERS:
            delta = self._delta(replica_id, stat, getattr(stats, stat))
            self.counters[name].labels(pool, method).inc(delta)
            key = (pool, method, stat)
            self._totals[key] = self._totals.get(key, 0.0) + delta
        for k, count in enumerate(stats.spec_k_histogram):
            self.chosen_k.labels(pool, str(k)).inc(self._delta(replica_id, f"k{k}", count))
        proposed = self._totals[(pool, method, "spec_proposed_tokens")]
        accepted = self._totals[(pool, method, "spec_accepted_tokens")]
        drafts = self._totals[(pool, method, "spec_num_drafts")]
        if proposed:
            self.acceptance_rate.labels(pool, method).set(accepted / proposed)
        if drafts:
            self.mean_accepted_length.labels(pool, method).set(accepted / drafts)

    def _delta(self, replica_id: str, stat: str, value: float) -> float:
        previous = self._last.get((replica_id, stat), 0.0)
        self._last[(replica_id, stat)] = value
        return max(value - previous, 0.0)

    def forget_replica(self, replica_id: str) -> None:
        for key in [k for k in self._last if k[0] == replica_id]:
            del self._last[key]
