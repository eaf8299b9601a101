"""RestartBackoff: how long a pool waits before starting replicas again after failures, so a
bad node or a broken image cannot cause a restart storm.

A failure is a replica that failed to start, or died before it had served healthy_after_s.
After n consecutive failures the pool waits base_s * 2**(n-1), at most max_s, before its
next start. A replica started after the last failure that has then served healthy_after_s
resets the count (older replicas say nothing about whether starts work now), so the death
of a long-lived replica is replaced at once.
"""

from __future__ import annotations


class RestartBackoff:
    def __init__(self, base_s: float, max_s: float, healthy_after_s: float):
        if not 0 < base_s <= max_s:
            raise ValueError("need 0 < base_s <= max_s")
        self.base_s, self.max_s, self.healthy_after_s = base_s, max_s, healthy_after_s
        self.num_failures = 0
        self.next_start_at = float("-inf")
        self.last_failure_at = float("-inf")

    @property
    def delay_s(self) -> float:
        """The wait after the failures so far (0: none)."""
        if not self.num_failures:
            return 0.0
        return min(self.base_s * 2 ** (self.num_failures - 1), self.max_s)

    def may_start(self, now: float) -> bool:
        return now >= self.next_start_at

    def record_failure(self, now: float) -> float:
        """Count a failure; returns the delay before the next start."""
        self.num_failures += 1
        self.last_failure_at = now
        self.next_start_at = now + self.delay_s
        return self.delay_s

    def died_young(self, ready_at: float | None, now: float) -> bool:
        return ready_at is None or now - ready_at < self.healthy_after_s

    def record_healthy(self, ready_at: float | None, now: float) -> None:
        """A replica is alive: once one started after the last failure has served
        healthy_after_s, the failures are forgiven."""
        if ready_at is None or ready_at <= self.last_failure_at:
            return
        if self.num_failures and not self.died_young(ready_at, now):
            self.num_failures = 0
            self.next_start_at = float("-inf")
