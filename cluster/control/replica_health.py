"""ReplicaHealth: the controller's health and replacement round, its parts (the round itself
is Controller.reconcile_once): each replica's state (pushed, or probed), what it tells (dead:
forget it; SIGTERM'd: drain it, its replacement starting once it is gone; alive: its load and
metrics), and starting what each pool misses, behind a per-pool exponential backoff against
restart storms (restart_backoff.py). It acts on the controller's books, passed whole."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.cluster.control.replica_probe import ProbeResult, probe
from splitserve.cluster.control.restart_backoff import RestartBackoff
from splitserve.cluster.control.worker_pool import Replica
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import POOLS

if TYPE_CHECKING:
    from splitserve.cluster.control.controller import Controller

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolEvent:
    """One replica lifecycle step (Controller.events, newest last)."""

    at: float  # monotonic seconds
    pool: str
    replica_id: str
    what: str  # "starting" (a replacement) | "started" | "start-failed" | "lost" | "adopted" | "sigterm" | "drained"
    detail: str = ""
    backoff_s: float = 0.0  # start-failed / lost: the pool's wait before its next start


class ReplicaHealth:
    def __init__(self, controller: Controller):
        self.controller = controller
        c = controller.cfg.controller
        self.backoff = {
            p: RestartBackoff(c.restart_backoff_s, c.restart_backoff_max_s, c.healthy_after_s) for p in POOLS
        }

    async def probe(self, replica: Replica) -> ProbeResult:
        """Its pushed state if fresh, else one probe() call."""
        c = self.controller
        result = None
        if c.state_feed is not None:
            result = await c.state_feed.result(replica)
        if result is None:
            result = await probe(replica)
        if replica.gang is not None and not result.dead:  # any rank lost is the replica lost
            broken = await replica.gang.probe_followers()
            if broken is not None:
                return ProbeResult(dead=True, kill=True, reason=broken)
        return result

    def observe(self, replica: Replica, result: ProbeResult, now: float) -> None:
        c = self.controller
        pool = replica.pool
        if c.pools[pool].get(replica.replica_id) is not replica:
            return  # removed while the probe ran
        if result.dead:
            young = self.backoff[pool].died_young(replica.ready_at, now)
            delay = self.backoff[pool].record_failure(now) if young else 0.0
            logger.warning(
                "%s replica %s is gone (%s); replacing it%s",
                pool,
                replica.replica_id,
                result.reason,
                f" in {delay:.1f} s" if delay else "",
            )
            c.roster.forget(pool, replica.replica_id, kill=result.kill)
            c.events.append(PoolEvent(now, pool, replica.replica_id, "lost", result.reason, delay))
        elif result.reply is not None:
            if result.reply.terminating and not replica.draining:
                logger.warning(
                    "%s replica %s got SIGTERM; draining it, its replacement starting", pool, replica.replica_id
                )
                c.events.append(PoolEvent(now, pool, replica.replica_id, "sigterm"))
                c.roster.set_draining(replica)  # now, so the next probe does not drain it again
                c.roster.spawn(c.drain_replica(pool, replica.replica_id, replace=True))
                # Not after the drain: the node is going away (a spot notice, a pod deletion),
                # so the capacity is restored while its streams move.
                self.replace_missing(pool, now)
            c.loads.update(pool, replica.replica_id, LoadReport.from_poll(result.reply))
            c.metrics.observe_poll(pool, replica.replica_id, result.reply)
            self.backoff[pool].record_healthy(replica.ready_at, now)

    def replace_missing(self, pool: str, now: float) -> None:
        c = self.controller
        missing = c.roster.missing(pool)
        if missing <= 0 or not self.backoff[pool].may_start(now):
            return
        for _ in range(missing):
            # Created here, not in the task: the pool counts it at once, so the next
            # replace_missing (the same round's, after a SIGTERM's) does not start another.
            replica = c.pools[pool].start_replica()
            c.events.append(PoolEvent(now, pool, replica.replica_id, "starting"))
            c.roster.spawn(self._await_replacement(replica))

    async def _await_replacement(self, replica: Replica) -> None:
        c = self.controller
        pool = replica.pool
        try:
            address = await c.roster.await_ready(replica)
        except Exception as exc:
            now = c.clock()
            delay = self.backoff[pool].record_failure(now)
            logger.warning(
                "starting %s failed (%s); %s retries in %.1f s", replica.replica_id, short_reason(exc), pool, delay
            )
            c.roster.forget(pool, replica.replica_id, kill=True)
            c.events.append(PoolEvent(now, pool, replica.replica_id, "start-failed", short_reason(exc), delay))
            c.roster.pending[pool] = short_reason(exc)
            c.roster.bump()  # /health shows it
            return
        c.roster.pending.pop(pool, None)
        c.roster.admit(replica, address)
        c.events.append(PoolEvent(c.clock(), pool, replica.replica_id, "started"))
        logger.info(
            "%s replica %s started (%d of %d)",
            pool,
            replica.replica_id,
            len(c.pools[pool].replicas),
            c.targets[pool],
        )


def short_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
