"""ReplicaDrain: taking one replica out of service without failing a request (a scale-down, a
SIGTERM'd replica, the driver API). The replica leaves the view first; once every live ingress
routes by that view and has nothing in flight there, and the replica itself is idle, it is
forgotten and killed. A decode replica still running streams after migrate_after_s hands them
to the others (they go on as continuations). It acts on the controller's books, passed whole."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from splitserve.cluster.control.replica_health import PoolEvent
from splitserve.cluster.control.replica_probe import probe
from splitserve.cluster.control.worker_pool import Replica, WorkerPool
from splitserve.cluster.routing.replica_pools import DECODE

if TYPE_CHECKING:
    from splitserve.cluster.control.controller import Controller

logger = logging.getLogger(__name__)
VIEW_APPLIED_TIMEOUT_S = 5.0  # how long the drain waits for the ingresses to stop polling it
MIGRATE_CALL_TIMEOUT_S = 30.0


class ReplicaDrain:
    def __init__(self, controller: Controller):
        self.controller = controller

    async def drain(self, pool: str, replica_id: str, timeout_s: float, replace: bool) -> bool:
        """Stop routing to a replica, wait until every live ingress routes by that view and
        has nothing in flight there and the replica is idle, then remove it. Returns False
        if requests were still in flight at the timeout (it is removed anyway). Lowers the
        pool's target (the replica is not replaced), unless replace (a SIGTERM'd replica:
        its replacement starts once it is gone)."""
        c = self.controller
        replica = c.pools[pool].get(replica_id)
        if replica is None:
            return True
        if not replica.draining:
            if not replace:
                c.targets[pool] = max(c.targets[pool] - 1, 0)
            c.roster.set_draining(replica)
        marked = c.version
        deadline = c.clock() + timeout_s
        migrate_after = c.cfg.migration.migrate_after_s if pool == DECODE else None
        migrate_at = None if migrate_after is None else c.clock() + migrate_after
        drained = False
        while not drained and c.clock() < deadline:
            now = c.clock()
            if migrate_at is not None and now >= migrate_at and c.ingresses.all_applied(marked, now):
                # No new request reaches it any more: hand what it still runs to the others.
                migrate_at = None
                await self._hand_off_streams(replica)
            drained = (
                c.ingresses.all_applied(marked, now)
                and c.ingresses.num_inflight(replica_id, now) == 0
                and (await probe(replica)).idle
            )
            if not drained:
                await asyncio.sleep(0.1)
        c.roster.forget(pool, replica_id, kill=False)
        # The ingresses stop polling it before it goes, so none sees a dead replica.
        await c.wait_applied(c.version, timeout_s=VIEW_APPLIED_TIMEOUT_S)
        await asyncio.to_thread(WorkerPool.kill, replica)
        c.events.append(PoolEvent(c.clock(), pool, replica_id, "drained", "" if drained else "timeout"))
        return drained

    @staticmethod
    async def _hand_off_streams(replica: Replica) -> None:
        """The decode replica moves the streams it still runs to other replicas."""
        try:
            handed = await asyncio.wait_for(replica.handle.migrate_streams.remote(), MIGRATE_CALL_TIMEOUT_S)
            logger.info("draining %s: %d stream(s) handed to other replicas", replica.replica_id, handed)
        except Exception as exc:  # gone meanwhile: nothing left to hand off
            logger.warning("draining %s: handing its streams off failed: %r", replica.replica_id, exc)
