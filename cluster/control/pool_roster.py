"""PoolRoster: the pools as the controller knows them -- every replica (starting or routable),
each pool's target, their loads and metric series, and the version of the view the ingresses
follow. The Controller decides; the roster keeps the books and tells the ingresses (every
change bumps the version and wakes their long polls).
"""

from __future__ import annotations

import asyncio
import logging
import time

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.pool_loads import PoolLoads
from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.cluster.control.replica_health import short_reason
from splitserve.cluster.control.worker_pool import Replica, WorkerPool, pools_for, reap_namespace
from splitserve.cluster.routing.replica_pools import DECODE, POOLS, PREFILL
from splitserve.cluster.scaling.policy import initial_replicas, replica_floor
from splitserve.proto.messages.membership import MembershipView

logger = logging.getLogger(__name__)


class PoolRoster:
    def __init__(self, cfg: ServeConfig, model_dir: str, namespace: str, hash_seed: str | None = None):
        self.namespace = namespace
        self.pools: dict[str, WorkerPool] = pools_for(cfg, model_dir, namespace, hash_seed)
        pool_cfgs = {PREFILL: cfg.prefill, DECODE: cfg.decode}
        self.targets = {p: initial_replicas(c.replicas, c.autoscaling) for p, c in pool_cfgs.items()}
        self.floors = {p: replica_floor(c.replicas, c.autoscaling) for p, c in pool_cfgs.items()}
        self.loads = PoolLoads()
        self.metrics = PoolMetrics(cfg.model_id, batch_priority=cfg.priority.batch)
        # Versions continue across controller restarts (ms since the epoch at start; a few
        # bumps per second at most), so an ingress never mistakes a new view for an old one.
        self.version = int(time.time() * 1000)
        self._changed = asyncio.Event()
        self.pending: dict[str, str] = {}  # per pool: why its last replica start failed
        self.lora_adapters: list[str] = list(cfg.lora_modules)  # what the ingresses serve (the view's)
        self._tasks: set[asyncio.Task] = set()

    # ---- the view --------------------------------------------------------------------------
    def view(self) -> MembershipView:
        replicas = [r.info(self.namespace) for pool in self.pools.values() for r in pool.live_replicas()]
        return MembershipView(
            version=self.version,
            replicas=replicas,
            expected=dict(self.targets),
            pending=dict(self.pending),
            lora_adapters=list(self.lora_adapters),
        )

    def bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, seen_version: int, wait_s: float) -> None:
        """Until the version moves past seen_version, at most wait_s."""
        if seen_version != self.version or wait_s <= 0:
            return
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), wait_s)
        except TimeoutError:
            pass

    # ---- replicas --------------------------------------------------------------------------
    async def adopt(self) -> tuple[list[Replica], list[Replica]]:
        """Re-adopt the live replicas a previous controller left (same actors, no reload): each
        one that answers joins the view, one that does not is removed; each pool's target rises
        to what it has. The replicas found, and those of them adopted."""
        found = [r for pool in self.pools.values() for r in await asyncio.to_thread(pool.adopt)]
        if not found:
            return [], []
        results = await asyncio.gather(*(self.await_ready(r) for r in found), return_exceptions=True)
        adopted = []
        for replica, result in zip(found, results):
            if isinstance(result, BaseException):
                logger.warning("cannot adopt %s (%s); removing it", replica.replica_id, short_reason(result))
                self.forget(replica.pool, replica.replica_id, kill=True)
            else:
                self.admit(replica, result)
                adopted.append(replica)
        for pool_name, pool in self.pools.items():
            self.targets[pool_name] = max(self.targets[pool_name], len(pool.replicas))
        logger.info("re-adopted %s", ", ".join(r.replica_id for r in found))
        return found, adopted

    async def await_ready(self, replica: Replica) -> tuple[str, int] | None:
        """Wait until the replica loaded its model; its request channel address."""
        timeout_s = self.pools[replica.pool].start_timeout_s
        if replica.gang is not None:  # a gang no node can hold fails here, naming its need
            await replica.gang.await_placement(self.pools[replica.pool].placement_timeout_s)
            replica.gang.nodes = await asyncio.to_thread(replica.gang.placed_nodes)
        try:
            await asyncio.wait_for(replica.handle.ready.remote(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"{replica.pool} replica {replica.replica_id} not ready after {timeout_s:.0f} s "
                f"(is there a node with the requested resources?)"
            ) from None
        address = await asyncio.wait_for(replica.handle.channel_address.remote(), 30)
        return tuple(address) if address else None

    def admit(self, replica: Replica, address: tuple[str, int] | None) -> None:
        """A ready replica joins the view."""
        self.pools[replica.pool].mark_ready(replica, address)
        self.loads.add(replica.pool, replica.replica_id, replica.draining)
        self.bump()

    def set_draining(self, replica: Replica) -> None:
        replica.draining = True
        self.loads.set_draining(replica.pool, replica.replica_id, True)
        self.bump()

    def forget(self, pool: str, replica_id: str, kill: bool) -> Replica | None:
        """Take a replica out of its pool and the view; its peers close their pairs with it.
        kill: end its actor too (in the background, without waiting for it to stop)."""
        replica = self.pools[pool].replicas.pop(replica_id, None)
        if replica is None:
            return None
        self.loads.remove(pool, replica_id)
        self.metrics.forget_replica(pool, replica_id)
        if replica.ready:
            self.bump()
        for peer in self.pools[DECODE if pool == PREFILL else PREFILL].live_replicas():
            peer.handle.forget_peer.remote(replica_id)
        if kill:
            self.spawn(asyncio.to_thread(WorkerPool.kill, replica, False))
        return replica

    def refilling(self, pool: str, starting: int = 0) -> bool:
        """The pool is below its target or has more replicas starting than the autoscaler's
        own `starting`: replacements are under way."""
        replicas = self.pools[pool].replicas
        return len(replicas) < self.targets[pool] or sum(not r.ready for r in replicas.values()) > starting

    def missing(self, pool: str) -> int:
        """Replicas to start to reach the target: those starting count as there, those draining
        do not (a scale-down lowered the target first; a SIGTERM'd replica's replacement starts
        while it drains)."""
        return self.targets[pool] - sum(not r.draining for r in self.pools[pool].replicas.values())

    async def kill_all(self, before_kill=None) -> None:
        """Kill every pool actor, then reap the namespace (an actor a previous controller was
        still starting has no entry here). The view loses them first; before_kill(version) may
        wait for the ingresses to route by it, so none finds a replica dead mid-shutdown."""
        replicas = [r for pool in self.pools.values() for r in pool.replicas.values()]
        for pool in self.pools.values():
            pool.replicas.clear()
        self.bump()
        if before_kill is not None:
            await before_kill(self.version)
        await asyncio.gather(*(asyncio.to_thread(WorkerPool.kill, r) for r in replicas), return_exceptions=True)
        left = await asyncio.to_thread(reap_namespace, self.namespace)
        if left:
            logger.info("reaped %s left in %s", ", ".join(left), self.namespace)
        self.bump()

    # ---- bookkeeping -----------------------------------------------------------------------
    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def refresh_gauges(self) -> None:
        for pool in POOLS:
            loads = [self.loads.load(pool, rid) for rid in self.loads.replica_ids(pool)]
            self.metrics.set_pool_totals(
                pool,
                len(loads),
                sum(l.report.num_waiting for l in loads),
                sum(l.report.num_running for l in loads),
            )
