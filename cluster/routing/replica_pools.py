"""ReplicaPools: the router's books on the replicas it routes to. Per pool (prefill, decode):
each registered replica's ReplicaLoad (its last load report, the requests routed there since,
draining) and the pool's KVIndex (which blocks each replica's prefix cache holds, fed by its KV
events, resynced from a snapshot after a gap). Registration, reports and queries live here;
the Router (router.py) builds on it and routes over these books. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from splitserve.cluster.routing.batch_headroom import BatchHeadroom
from splitserve.cluster.routing.index import KVIndex
from splitserve.cluster.routing.load import LoadReport, ReplicaLoad

PREFILL = "prefill"
DECODE = "decode"
POOLS = (PREFILL, DECODE)


class UnknownReplicaError(KeyError):
    """A replica id that is not registered in the named pool."""


class ReplicaPools:
    def __init__(self) -> None:
        self._loads: dict[str, dict[Hashable, ReplicaLoad]] = {p: {} for p in POOLS}
        self._indexes: dict[str, KVIndex] = {p: KVIndex() for p in POOLS}

    # ---- registration and reports --------------------------------------------------------
    def add_replica(self, pool: str, replica_id: Hashable, snapshot: tuple[Any, ...] | None = None) -> None:
        """Register a replica; snapshot is its engine's snapshot(): (seq, device hashes), and
        its host tier's hashes third when it has one (None: empty cache)."""
        loads = self._pool(pool)
        if replica_id in loads:
            raise ValueError(f"{pool} replica {replica_id!r} is already registered")
        seq, hashes, *host = snapshot if snapshot is not None else (0, ())
        self._indexes[pool].add_replica(replica_id, seq, hashes, host[0] if host else ())
        loads[replica_id] = ReplicaLoad(replica_id)

    def remove_replica(self, pool: str, replica_id: Hashable) -> None:
        """Forget a dead or drained replica and its index entries. Unknown ids are ignored."""
        self._pool(pool).pop(replica_id, None)
        self._indexes[pool].remove_replica(replica_id)

    def set_draining(self, pool: str, replica_id: Hashable, draining: bool) -> None:
        self._load(pool, replica_id).draining = draining

    def update_load(self, pool: str, replica_id: Hashable, report: LoadReport) -> bool:
        """Take a load report. Returns False (ignored) for a replica no longer registered:
        a report can race with its removal."""
        load = self._pool(pool).get(replica_id)
        if load is None:
            return False
        load.update(report)
        return True

    def apply_events(self, pool: str, replica_id: Hashable, events: Sequence[Any]) -> bool:
        """Feed a replica's KV events. False: unregistered replica, or a seq gap (the replica
        is then listed by replicas_needing_resync until resync())."""
        if replica_id not in self._pool(pool):
            return False
        return self._indexes[pool].apply_events(replica_id, events)

    def resync(self, pool: str, replica_id: Hashable, snapshot: tuple[Any, ...]) -> None:
        self._load(pool, replica_id)
        seq, hashes, *host = snapshot
        self._indexes[pool].resync(replica_id, seq, hashes, host[0] if host else ())

    def replicas_needing_resync(self, pool: str) -> list[Hashable]:
        loads = self._pool(pool)
        return [r for r in self._indexes[pool].replicas_needing_resync() if r in loads]

    # ---- queries -------------------------------------------------------------------------
    def index(self, pool: str) -> KVIndex:
        self._pool(pool)
        return self._indexes[pool]

    def load(self, pool: str, replica_id: Hashable) -> ReplicaLoad:
        return self._load(pool, replica_id)

    def replica_ids(self, pool: str, include_draining: bool = True) -> list[Hashable]:
        return [r for r, load in self._pool(pool).items() if include_draining or not load.draining]

    def replicas_without_headroom(self, pool: str, max_kv_usage: float, max_running: int) -> set[Hashable]:
        """Replicas at or above either threshold (KV usage as last reported; running requests
        including those routed since): where sheddable (batch) work must not go."""
        headroom = BatchHeadroom(max_kv_usage, max_running)
        return {rid for rid, load in self._loads[pool].items() if not headroom.admits(load)}

    def _candidates(self, pool: str, exclude: Iterable[Hashable]) -> list[ReplicaLoad]:
        """The pool's replicas a request may go to: not draining, not excluded."""
        excluded = set(exclude)
        return [load for rid, load in self._loads[pool].items() if not load.draining and rid not in excluded]

    def _pool(self, pool: str) -> dict[Hashable, ReplicaLoad]:
        try:
            return self._loads[pool]
        except KeyError:
            raise ValueError(f"unknown pool {pool!r}; expected one of {POOLS}") from None

    def _load(self, pool: str, replica_id: Hashable) -> ReplicaLoad:
        load = self._pool(pool).get(replica_id)
        if load is None:
            raise UnknownReplicaError(f"{pool} replica {replica_id!r} is not registered")
        return load
