"""ScalableCluster: what the autoscaler reads and drives. The controller (the service) and
DisaggCluster (the driver API of tests and benchmarks) both implement it; tests drive the
autoscaler through a double (tests/cluster/scaling/test_cluster_view.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from splitserve.cluster.routing.load import ReplicaLoad


class LoadView(Protocol):
    """Each replica's load, by pool: the controller's probes (PoolLoads) or a router's view.
    Replica ids are the pool's own (str in the controller, any hashable in a router)."""

    def replica_ids(self, pool: str, include_draining: bool = True) -> Sequence[Any]: ...

    def load(self, pool: str, replica_id: Any) -> ReplicaLoad: ...


@runtime_checkable
class ScalableCluster(Protocol):
    @property
    def loads(self) -> LoadView: ...

    def refilling(self, pool: str, starting: int = 0) -> bool:
        """Replacing lost replicas of the pool (their absence is not load: hold). starting:
        replicas the autoscaler itself is starting there, which are not a refill."""
        ...

    async def add_replicas(self, pool: str, num: int = 1) -> Sequence[Any]:
        """Start num replicas; return once they are routable."""
        ...

    async def drain_replica(self, pool: str, replica_id: str, timeout_s: float = 120.0) -> bool:
        """No new requests, in-flight ones finish, then removed; False: it did not drain in time."""
        ...
