"""PoolLoads: the controller's view of every replica's load, from its own probes (what each
replica reports about itself, whichever ingress sent it the work). The autoscaler reads it
through the same two queries it asks of a router (replica_ids, load)."""

from __future__ import annotations

from splitserve.cluster.routing.load import LoadReport, ReplicaLoad
from splitserve.cluster.routing.replica_pools import POOLS


class PoolLoads:
    def __init__(self):
        self._loads: dict[str, dict[str, ReplicaLoad]] = {pool: {} for pool in POOLS}

    def add(self, pool: str, replica_id: str, draining: bool = False) -> None:
        self._loads[pool].setdefault(replica_id, ReplicaLoad(replica_id, draining=draining))

    def remove(self, pool: str, replica_id: str) -> None:
        self._loads[pool].pop(replica_id, None)

    def set_draining(self, pool: str, replica_id: str, draining: bool) -> None:
        load = self._loads[pool].get(replica_id)
        if load is not None:
            load.draining = draining

    def update(self, pool: str, replica_id: str, report: LoadReport) -> None:
        load = self._loads[pool].get(replica_id)
        if load is not None:
            load.update(report)

    def replica_ids(self, pool: str, include_draining: bool = True) -> list[str]:
        return [rid for rid, load in self._loads[pool].items() if include_draining or not load.draining]

    def load(self, pool: str, replica_id: str) -> ReplicaLoad:
        return self._loads[pool][replica_id]
