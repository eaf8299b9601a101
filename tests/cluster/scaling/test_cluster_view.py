"""The autoscaler drives any ScalableCluster: a test double (load views and replica calls, no
Ray) scales up on load, holds while the cluster refills, and drains the least-loaded replica."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.pool_loads import PoolLoads
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.cluster.scaling.autoscaler import Autoscaler
from splitserve.cluster.scaling.cluster_view import ScalableCluster


@dataclass
class AddedReplica:
    replica_id: str


class FakeCluster:
    """A ScalableCluster in memory: replicas are load entries; calls are recorded."""

    def __init__(self) -> None:
        self.pool_loads = PoolLoads()
        self.is_refilling = False
        self.calls: list[tuple[str, str, int | str]] = []

    @property
    def loads(self) -> PoolLoads:
        return self.pool_loads

    def refilling(self, pool: str, starting: int = 0) -> bool:
        return self.is_refilling

    async def add_replicas(self, pool: str, num: int = 1) -> list[AddedReplica]:
        self.calls.append(("add", pool, num))
        added = [AddedReplica(f"{pool}-new-{len(self.calls)}-{i}") for i in range(num)]
        for replica in added:
            self.pool_loads.add(pool, replica.replica_id)
        return added

    async def drain_replica(self, pool: str, replica_id: str, timeout_s: float = 120.0) -> bool:
        self.calls.append(("drain", pool, replica_id))
        self.pool_loads.remove(pool, replica_id)
        return True

    def report(self, pool: str, replica_id: str, report: LoadReport, at: float) -> None:
        """A replica's load report, received at `at` on the test's clock (a real one is stamped
        with time.monotonic(), which the test's clock is not: the autoscaler would read a report
        from the clock's future or past as fresh or stale by the machine's uptime)."""
        self.pool_loads.update(pool, replica_id, report)
        self.pool_loads.load(pool, replica_id).updated_at = at


def _config() -> ServeConfig:
    autoscaling = {"enabled": True, "min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 0, "downscale_delay_s": 0}
    return ServeConfig.model_validate({"decode": {"autoscaling": autoscaling}})


async def _settle(autoscaler: Autoscaler) -> None:
    while autoscaler.scaling_in_progress(DECODE):
        await asyncio.sleep(0.01)


def test_the_autoscaler_drives_a_cluster_double():
    async def scenario() -> None:
        fake = FakeCluster()
        cluster: ScalableCluster = fake  # the double type-checks as the autoscaler's cluster
        assert isinstance(cluster, ScalableCluster)
        now = [100.0]
        fake.pool_loads.add(DECODE, "d0")
        fake.report(DECODE, "d0", LoadReport(num_running=1000, kv_usage=1.0), now[0])
        autoscaler = Autoscaler(cluster, _config(), clock=lambda: now[0])

        fake.is_refilling = True  # lost replicas are being replaced: their absence is not load
        assert autoscaler.step(DECODE) is None and fake.calls == []

        fake.is_refilling = False
        decision = autoscaler.step(DECODE)
        assert decision is not None and decision.action == "up", decision
        await _settle(autoscaler)
        assert fake.calls == [("add", DECODE, 1)]
        assert [(e.action, e.from_replicas, e.to_replicas, e.ok) for e in autoscaler.events] == [("up", 1, 2, True)]

        # idle now: the busier replica stays, the idle new one is drained
        now[0] += 1000.0
        fake.report(DECODE, "d0", LoadReport(num_running=1), now[0])
        fake.report(DECODE, "decode-new-1-0", LoadReport(), now[0])
        decision = autoscaler.step(DECODE)
        assert decision is not None and decision.action == "down", decision
        await _settle(autoscaler)
        assert fake.calls[-1] == ("drain", DECODE, "decode-new-1-0")
        assert fake.pool_loads.replica_ids(DECODE) == ["d0"]

    asyncio.run(scenario())


def test_the_roster_tells_the_autoscalers_own_starts_from_a_refill(tiny_model):
    """The controller's books, no Ray: replicas starting that the autoscaler asked for are not a
    refill (the `sla` policy may start more meanwhile); one more starting than it asked for,
    or a pool below its target (a replica lost), is."""
    from splitserve.cluster.control.pool_roster import PoolRoster
    from splitserve.cluster.control.worker_pool import Replica

    roster = PoolRoster(_config(), tiny_model, "unit")
    replicas = roster.pools[DECODE].replicas
    replicas["decode-0"] = Replica("decode-0", DECODE, handle=None, ready=True)
    assert not roster.refilling(DECODE)
    roster.targets[DECODE] = 3  # the autoscaler asked for two more: both starting
    replicas.update({rid: Replica(rid, DECODE, handle=None) for rid in ("decode-1", "decode-2")})
    assert roster.refilling(DECODE) and roster.refilling(DECODE, starting=1)
    assert not roster.refilling(DECODE, starting=2)
    del replicas["decode-0"]  # lost while they start
    assert roster.refilling(DECODE, starting=2)
