"""Settled usage not yet written to the store, per (tenant, model, UTC hour); the gate's sync
tick moves it to the SqlUsageStore in one transaction. A failed write keeps it for the next
tick, and shutdown writes what is left, so only a killed replica loses its last tick's usage."""

from __future__ import annotations

from collections import defaultdict

from splitserve.cluster.tenants.quota_window import hour_start
from splitserve.cluster.tenants.sql_usage_store import SqlUsageStore, UsageCounts


class UsageMeter:
    def __init__(self, store: SqlUsageStore):
        self.store = store
        self._pending: dict[tuple[str, str, int], UsageCounts] = defaultdict(UsageCounts)

    def record(self, tenant: str, model: str, now: float, counts: UsageCounts) -> None:
        self._pending[(tenant, model, hour_start(now))].add(counts)

    def flush(self) -> None:
        """Writes the pending usage (called on a worker thread); on failure it stays pending."""
        batch, self._pending = self._pending, defaultdict(UsageCounts)
        try:
            self.store.add(dict(batch))
        except BaseException:
            for key, counts in batch.items():
                self._pending[key].add(counts)
            raise
