"""Controller: owns the prefill and decode pools, independent of any frontend.

It starts the pools (named, detached actors in the app's namespace, cluster/control/
worker_pool.py), re-adopts the live ones after a restart (same actors, no reload), probes
every replica for health and load, replaces replicas that died or whose engine loop stopped
until each pool is back at its target (with a per-pool exponential backoff against restart
storms, cluster/control/restart_backoff.py), runs the autoscaler and drains replicas.

The ingresses learn the pools from it: membership() answers a MembershipView whenever it
changed (long-polled), and takes each ingress's IngressReport (in-flight requests per replica
for drains, latency samples for the autoscaler, Prometheus samples for the merged /metrics).

A plain class: the Serve app wraps it in a one-replica deployment (cluster/app.py), and
DisaggCluster runs it in-process for tests and the bench.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.ingress_registry import IngressRegistry
from splitserve.cluster.control.ingress_report import IngressReport, decode_families
from splitserve.cluster.control.membership import MembershipView
from splitserve.cluster.control.metrics_aggregator import MetricsAggregator
from splitserve.cluster.control.pool_loads import PoolLoads
from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.cluster.control.replica_probe import ProbeResult, probe
from splitserve.cluster.control.restart_backoff import RestartBackoff
from splitserve.cluster.control.worker_pool import Replica, WorkerPool, app_namespace, pools_for, reap_namespace
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.router import DECODE, POOLS, PREFILL
from splitserve.cluster.scaling.autoscaler import Autoscaler
from splitserve.cluster.scaling.latency_window import LatencyWindow
from splitserve.cluster.scaling.policy import initial_replicas, replica_floor

logger = logging.getLogger(__name__)
IDLE_PAIR_S = 300.0  # decode replicas close process groups idle this long


@dataclass(frozen=True)
class PoolEvent:
    """One replica lifecycle step (Controller.events, newest last)."""

    at: float  # monotonic seconds
    pool: str
    replica_id: str
    what: str  # "starting" (a replacement) | "started" | "start-failed" | "lost" | "adopted" | "drained"
    detail: str = ""
    backoff_s: float = 0.0  # start-failed / lost: the pool's wait before its next start


class Controller:
    def __init__(
        self,
        cfg: ServeConfig,
        model_dir: str,
        app_name: str,
        autoscale: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.namespace = app_namespace(app_name)
        self.clock = clock
        self.pools: dict[str, WorkerPool] = pools_for(cfg, model_dir, self.namespace)
        pool_cfgs = {PREFILL: cfg.prefill, DECODE: cfg.decode}
        self.targets = {p: initial_replicas(c.replicas, c.autoscaling) for p, c in pool_cfgs.items()}
        self.floors = {p: replica_floor(c.replicas, c.autoscaling) for p, c in pool_cfgs.items()}
        c = cfg.controller
        self.backoff = {
            p: RestartBackoff(c.restart_backoff_s, c.restart_backoff_max_s, c.healthy_after_s) for p in POOLS
        }
        self.loads = PoolLoads()
        self.ingresses = IngressRegistry(c.ingress_timeout_s)
        self.metrics = PoolMetrics()
        self.aggregator = MetricsAggregator()
        self.ttft_window, self.itl_window = LatencyWindow(), LatencyWindow()
        # Versions continue across controller restarts (ms since the epoch at start; a few
        # bumps per second at most), so an ingress never mistakes a new view for an old one.
        self.version = int(time.time() * 1000)
        self._changed = asyncio.Event()
        self.events: list[PoolEvent] = []
        self.autoscaler = None
        if autoscale and (cfg.prefill.autoscaling.enabled or cfg.decode.autoscaling.enabled):
            self.autoscaler = Autoscaler(self, cfg, self.metrics, latency_source=self.recent_latency_ms)
        self._tasks: set[asyncio.Task] = set()
        self._reconciler: asyncio.Task | None = None
        self._last_idle_sweep = clock()

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Adopt the live replicas a previous controller left; on a fresh start, start every
        pool at its target and raise if one fails (nothing is left running). A restarted
        controller does not fail: what is missing is started by the reconciler, with backoff."""
        adopted = await self._adopt()
        if not adopted:
            starts = [self.add_replicas(p, n, count=False) for p, n in self.targets.items() if n]
            results = await asyncio.gather(*starts, return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                await self._kill_all()
                raise failed
        self._refresh_gauges()
        self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_forever(), name="controller")
        if self.autoscaler is not None:
            self.autoscaler.start()

    async def shutdown(self) -> None:
        """Stop deciding, then kill every pool actor (and reap the namespace: an actor a
        previous controller was still starting has no entry here)."""
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        tasks = [t for t in [self._reconciler, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._kill_all()

    async def _kill_all(self) -> None:
        replicas = [r for pool in self.pools.values() for r in pool.replicas.values()]
        for pool in self.pools.values():
            pool.replicas.clear()
        await asyncio.gather(*(asyncio.to_thread(WorkerPool.kill, r) for r in replicas), return_exceptions=True)
        left = await asyncio.to_thread(reap_namespace, self.namespace)
        if left:
            logger.info("reaped %s left in %s", ", ".join(left), self.namespace)
        self._bump()

    async def _adopt(self) -> int:
        found = [r for pool in self.pools.values() for r in await asyncio.to_thread(pool.adopt)]
        if not found:
            return 0
        results = await asyncio.gather(*(self._await_ready(r) for r in found), return_exceptions=True)
        for replica, result in zip(found, results):
            if isinstance(result, BaseException):
                logger.warning("cannot adopt %s (%s); removing it", replica.replica_id, _short(result))
                self._forget(replica.pool, replica.replica_id, kill=True)
            else:
                self._admit(replica, result)
                self.events.append(PoolEvent(self.clock(), replica.pool, replica.replica_id, "adopted"))
        for pool_name, pool in self.pools.items():
            self.targets[pool_name] = max(self.targets[pool_name], len(pool.replicas))
        logger.info("re-adopted %s", ", ".join(r.replica_id for r in found))
        return len(found)

    # ---- what ingresses call -------------------------------------------------------------
    def view(self) -> MembershipView:
        replicas = [r.info(self.namespace) for pool in self.pools.values() for r in pool.live_replicas()]
        return MembershipView(version=self.version, replicas=replicas, expected=dict(self.targets))

    async def membership(
        self, seen_version: int, ingress_id: str, report: bytes | None = None, wait_s: float = 0.0
    ) -> bytes | None:
        """The current view (MembershipView bytes) if it differs from seen_version (the one
        the ingress has applied), else None after waiting up to wait_s for a change."""
        now = self.clock()
        parsed = IngressReport.from_bytes(report) if report else None
        self.ingresses.seen(ingress_id, seen_version, parsed.inflight if parsed else None, now)
        if parsed is not None:
            self._take_report(ingress_id, parsed, now)
        if seen_version == self.version and wait_s > 0:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), wait_s)
            except TimeoutError:
                pass
        return None if seen_version == self.version else self.view().to_bytes()

    def render_metrics(self, ingress_id: str | None = None, families: bytes | None = None) -> bytes:
        """The merged /metrics text; families: the calling ingress's current samples."""
        self._refresh_gauges()
        if ingress_id is not None and families:
            self.aggregator.update(ingress_id, decode_families(families))
        return self.aggregator.render(self.metrics.registry)

    def recent_latency_ms(self, pool: str, since: float | None = None) -> float | None:
        """p90 over the ingresses' recent samples: TTFT for prefill, ITL for decode."""
        return (self.ttft_window if pool == PREFILL else self.itl_window).percentile_ms(90, since)

    def _take_report(self, ingress_id: str, report: IngressReport, now: float) -> None:
        for window, samples in ((self.ttft_window, report.ttft), (self.itl_window, report.itl)):
            for age_s, seconds in samples:
                window.observe(seconds, now - age_s)
        if report.metrics is not None:
            self.aggregator.update(ingress_id, report.metrics)

    # ---- scaling (the autoscaler and the driver API call these) ---------------------------
    async def add_replicas(self, pool: str, num: int = 1, count: bool = True) -> list[Replica]:
        """Start replicas, wait until they loaded, then make them routable (and wait, briefly,
        until the ingresses route by the new view). All or nothing: if one fails, every one
        is removed and the error raised. count: raise the pool's target by num."""
        worker_pool = self.pools[pool]
        if count:
            self.targets[pool] += num
        replicas = [worker_pool.start_replica() for _ in range(num)]
        results = await asyncio.gather(*(self._await_ready(r) for r in replicas), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            if count:
                self.targets[pool] -= num
            for r in replicas:
                self._forget(pool, r.replica_id, kill=True)
            raise failed
        for replica, address in zip(replicas, results):
            self._admit(replica, address)
            self.events.append(PoolEvent(self.clock(), pool, replica.replica_id, "started"))
        await self.wait_applied(self.version, timeout_s=5.0)
        return replicas

    async def drain_replica(self, pool: str, replica_id: str, timeout_s: float = 120.0) -> bool:
        """Stop routing to a replica, wait until every live ingress routes by that view and
        has nothing in flight there and the replica is idle, then remove it. Returns False
        if requests were still in flight at the timeout (it is removed anyway). Lowers the
        pool's target: the replica is not replaced."""
        replica = self.pools[pool].get(replica_id)
        if replica is None:
            return True
        if not replica.draining:
            replica.draining = True
            self.targets[pool] = max(self.targets[pool] - 1, 0)
            self.loads.set_draining(pool, replica_id, True)
            self._bump()
        marked = self.version
        deadline = self.clock() + timeout_s
        drained = False
        while not drained and self.clock() < deadline:
            now = self.clock()
            drained = (
                self.ingresses.all_applied(marked, now)
                and self.ingresses.num_inflight(replica_id, now) == 0
                and (await probe(replica)).idle
            )
            if not drained:
                await asyncio.sleep(0.1)
        self._forget(pool, replica_id, kill=False)
        # The ingresses stop polling it before it goes, so none sees a dead replica.
        await self.wait_applied(self.version, timeout_s=5.0)
        await asyncio.to_thread(WorkerPool.kill, replica)
        self.events.append(PoolEvent(self.clock(), pool, replica_id, "drained", "" if drained else "timeout"))
        return drained

    def refilling(self, pool: str) -> bool:
        """The pool is below its target or has replicas starting: replacements are under way
        (the autoscaler holds meanwhile, or it would count a dead replica's loss as load)."""
        replicas = self.pools[pool].replicas
        return len(replicas) < self.targets[pool] or any(not r.ready for r in replicas.values())

    async def wait_applied(self, version: int, timeout_s: float) -> bool:
        """Wait until every live ingress routes by `version` or later; False at the timeout."""
        deadline = self.clock() + timeout_s
        while not self.ingresses.all_applied(version, self.clock()):
            if self.clock() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def close_idle_pairs(self, max_idle_s: float) -> None:
        """Decode replicas drop process groups idle for max_idle_s; their prefill peers follow."""
        for decode in list(self.pools[DECODE].live_replicas()):
            try:
                closed = await asyncio.wait_for(decode.handle.close_idle_pairs.remote(max_idle_s), 30)
            except (TimeoutError, ray.exceptions.RayError):
                continue
            for prefill_id in closed:
                prefill = self.pools[PREFILL].get(prefill_id)
                if prefill is not None:
                    prefill.handle.forget_peer.remote(decode.replica_id)

    # ---- health and replacement -----------------------------------------------------------
    async def reconcile_once(self) -> None:
        """Probe every replica, drop the dead, retire silent ingresses, start what is missing."""
        live = [r for pool in self.pools.values() for r in pool.live_replicas()]
        results = await asyncio.gather(*(probe(r) for r in live))
        now = self.clock()
        for replica, result in zip(live, results):
            self._observe(replica, result, now)
        for ingress_id in self.ingresses.expire(now):
            logger.info("ingress %s went silent; retiring its metrics", ingress_id)
            self.aggregator.retire(ingress_id)
        for pool in POOLS:
            self._replace_missing(pool, now)
        self._refresh_gauges()
        if now - self._last_idle_sweep > IDLE_PAIR_S / 4:
            self._last_idle_sweep = now
            await self.close_idle_pairs(IDLE_PAIR_S)

    def _observe(self, replica: Replica, result: ProbeResult, now: float) -> None:
        pool = replica.pool
        if self.pools[pool].get(replica.replica_id) is not replica:
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
            self._forget(pool, replica.replica_id, kill=result.kill)
            self.events.append(PoolEvent(now, pool, replica.replica_id, "lost", result.reason, delay))
        elif result.reply is not None:
            self.loads.update(pool, replica.replica_id, LoadReport.from_poll(result.reply))
            self.metrics.observe_poll(pool, replica.replica_id, result.reply)
            self.backoff[pool].record_healthy(replica.ready_at, now)

    def _replace_missing(self, pool: str, now: float) -> None:
        missing = self.targets[pool] - len(self.pools[pool].replicas)  # starting ones count
        if missing <= 0 or not self.backoff[pool].may_start(now):
            return
        for _ in range(missing):
            self._spawn(self._replace_one(pool))

    async def _replace_one(self, pool: str) -> None:
        replica = self.pools[pool].start_replica()
        self.events.append(PoolEvent(self.clock(), pool, replica.replica_id, "starting"))
        try:
            address = await self._await_ready(replica)
        except Exception as exc:
            now = self.clock()
            delay = self.backoff[pool].record_failure(now)
            logger.warning(
                "starting %s failed (%s); %s retries in %.1f s", replica.replica_id, _short(exc), pool, delay
            )
            self._forget(pool, replica.replica_id, kill=True)
            self.events.append(PoolEvent(now, pool, replica.replica_id, "start-failed", _short(exc), delay))
            return
        self._admit(replica, address)
        self.events.append(PoolEvent(self.clock(), pool, replica.replica_id, "started"))
        logger.info(
            "%s replica %s started (%d of %d)",
            pool,
            replica.replica_id,
            len(self.pools[pool].replicas),
            self.targets[pool],
        )

    async def _reconcile_forever(self) -> None:
        while True:
            try:
                await self.reconcile_once()
            except Exception:
                logger.exception("controller reconcile failed")
            await asyncio.sleep(self.cfg.controller.probe_interval_s)

    # ---- membership bookkeeping ------------------------------------------------------------
    async def _await_ready(self, replica: Replica) -> tuple[str, int] | None:
        """Wait until the replica loaded its model; its request channel address."""
        timeout_s = self.pools[replica.pool].start_timeout_s
        try:
            await asyncio.wait_for(replica.handle.ready.remote(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"{replica.pool} replica {replica.replica_id} not ready after {timeout_s:.0f} s "
                f"(is there a node with the requested resources?)"
            ) from None
        address = await asyncio.wait_for(replica.handle.channel_address.remote(), 30)
        return tuple(address) if address else None

    def _admit(self, replica: Replica, address: tuple[str, int] | None) -> None:
        self.pools[replica.pool].mark_ready(replica, address)
        self.loads.add(replica.pool, replica.replica_id, replica.draining)
        self._bump()

    def _forget(self, pool: str, replica_id: str, kill: bool) -> None:
        """Take a replica out of its pool and the view; its peers close their pairs with it."""
        replica = self.pools[pool].replicas.pop(replica_id, None)
        if replica is None:
            return
        self.loads.remove(pool, replica_id)
        self.metrics.forget_replica(pool, replica_id)
        if replica.ready:
            self._bump()
        for peer in self.pools[DECODE if pool == PREFILL else PREFILL].live_replicas():
            peer.handle.forget_peer.remote(replica_id)
        if kill:
            self._spawn(asyncio.to_thread(WorkerPool.kill, replica, False))

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refresh_gauges(self) -> None:
        for pool in POOLS:
            loads = [self.loads.load(pool, rid) for rid in self.loads.replica_ids(pool)]
            self.metrics.set_pool_totals(
                pool,
                len(loads),
                sum(l.report.num_waiting for l in loads),
                sum(l.report.num_running for l in loads),
            )


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
