"""Controller: owns the prefill and decode pools, independent of any frontend.

It starts the pools (named, detached actors in the app's namespace, cluster/control/
worker_pool.py), re-adopts the live ones after a restart (same actors, no reload), probes
every replica for health and load (reading what each replica pushes to it, replica_state_feed.py,
and calling probe() only for a replica with no fresh push), replaces replicas that died or whose engine loop stopped
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
import contextlib
import logging
import time
from collections.abc import Callable

import ray

from splitserve.cluster.bounded_log import BoundedLog
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.ingress_registry import IngressRegistry
from splitserve.cluster.control.lora_adapter_control import UNLOAD_TIMEOUT_S, LoraAdapterControl
from splitserve.cluster.control.metrics_aggregator import MetricsAggregator
from splitserve.cluster.control.pool_roster import PoolRoster
from splitserve.cluster.control.replica_drain import ReplicaDrain
from splitserve.cluster.control.replica_health import PoolEvent, ReplicaHealth
from splitserve.cluster.control.replica_state_feed import ReplicaStateFeed
from splitserve.cluster.control.worker_pool import Replica, app_namespace
from splitserve.cluster.routing.replica_pools import DECODE, POOLS, PREFILL
from splitserve.cluster.scaling.autoscaler import Autoscaler
from splitserve.cluster.scaling.latency_window import LatencyWindow
from splitserve.cluster.scaling.load_forecast import DemandTotals
from splitserve.proto.messages.ingress_report import IngressReport, decode_families
from splitserve.proto.messages.membership import MembershipView

logger = logging.getLogger(__name__)
IDLE_PAIR_S = 300.0  # decode replicas close process groups idle this long
# The newest replica events kept (Controller.events): a replica's whole life is a few of them, so
# this covers hundreds of replacements while memory stays bounded however long the service runs.
EVENT_LOG_SIZE = 1024
SHUTDOWN_WITHDRAW_S = 1.0  # how long a shutdown waits for the ingresses to stop routing to the pools


class Controller:
    def __init__(
        self,
        cfg: ServeConfig,
        model_dir: str,
        app_name: str,
        autoscale: bool = True,
        clock: Callable[[], float] = time.monotonic,
        namespace: str | None = None,
        aggregator: MetricsAggregator | None = None,
        hash_seed: str | None = None,
    ):
        """namespace: where this model's pool actors live (default: the app's); aggregator:
        one shared by the controllers of a deployment's models (ModelControllers), which then
        keeps each ingress's samples per model; hash_seed: the engines' block-hash seed (the
        model's name where the deployment serves several; its ingresses route with the same)."""
        self.cfg = cfg
        self.clock = clock
        self.model_name = cfg.model_id
        self.roster = PoolRoster(cfg, model_dir, namespace or app_namespace(app_name), hash_seed)
        c = cfg.controller
        self.health = ReplicaHealth(self)
        self.ingresses = IngressRegistry(c.ingress_timeout_s)
        self.aggregator = aggregator or MetricsAggregator()
        # A shared aggregator hears every model's copy of an ingress's samples: keep them apart.
        self._shared_metrics = aggregator is not None
        self.ttft_window, self.itl_window = LatencyWindow(), LatencyWindow()
        self.events: BoundedLog[PoolEvent] = BoundedLog(EVENT_LOG_SIZE)
        self.autoscaler = None
        if autoscale and (cfg.prefill.autoscaling.enabled or cfg.decode.autoscaling.enabled):
            self.autoscaler = Autoscaler(
                self,
                cfg,
                self.metrics,
                latency_source=self.recent_latency_ms,
                demand_source=self.demand_totals,
                model_dir=model_dir,
            )
        self.lora = LoraAdapterControl(self)
        self.replica_drain = ReplicaDrain(self)
        self._reconciler: asyncio.Task | None = None
        self._last_idle_sweep = clock()
        self.state_feed = None  # with replica_state.updates "poll", every round probes every replica
        if cfg.replica_state.updates == "push":
            self.state_feed = ReplicaStateFeed(
                f"controller-{app_name}", c.probe_interval_s, cfg.replica_state.heartbeat_s
            )

    # The roster's books, as the autoscaler, the driver API and tests read them.
    namespace = property(lambda self: self.roster.namespace)
    pools = property(lambda self: self.roster.pools)
    targets = property(lambda self: self.roster.targets)
    loads = property(lambda self: self.roster.loads)
    metrics = property(lambda self: self.roster.metrics)
    version = property(lambda self: self.roster.version)
    backoff = property(lambda self: self.health.backoff)  # per pool, against restart storms

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
                await self.roster.kill_all()
                raise failed
        self.roster.refresh_gauges()
        self.resume()
        if self.autoscaler is not None:
            self.autoscaler.start()

    async def shutdown(self) -> None:
        """Stop deciding, then kill every pool actor (and reap the namespace: an actor a
        previous controller was still starting has no entry here)."""
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        await self.pause()
        if self.state_feed is not None:
            await self.state_feed.close()
        await self.roster.cancel_tasks()
        # The ingresses stop routing to the pools before they go (a second at most: an
        # ingress that does not answer is going away too).
        await self.roster.kill_all(before_kill=lambda version: self.wait_applied(version, SHUTDOWN_WITHDRAW_S))

    async def pause(self) -> None:
        """Stop probing and replacing (the view stays as it is), as if this controller were gone."""
        if self._reconciler is not None:
            self._reconciler.cancel()
            await asyncio.gather(self._reconciler, return_exceptions=True)
            self._reconciler = None

    def resume(self) -> None:
        """Probe and replace again, every probe_interval_s."""
        if self._reconciler is None:
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_forever(), name="controller")

    async def _adopt(self) -> int:
        """How many live replicas a previous controller left, adopted or not (PoolRoster.adopt):
        any at all means a restart, which leaves what is missing to the reconciler."""
        found, adopted = await self.roster.adopt()
        for replica in adopted:
            self.events.append(PoolEvent(self.clock(), replica.pool, replica.replica_id, "adopted"))
        return len(found)

    # ---- what ingresses call -------------------------------------------------------------
    def view(self) -> MembershipView:
        return self.roster.view()

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
        await self.roster.wait_changed(seen_version, wait_s)
        return None if seen_version == self.version else self.view().to_bytes()

    async def load_lora_adapter(self, name: str, path: str) -> tuple[int, str]:
        """Serve another LoRA adapter on every replica: (HTTP status, message); lora_adapter_control.py."""
        return await self.lora.load(name, path)

    async def unload_lora_adapter(self, name: str, timeout_s: float = UNLOAD_TIMEOUT_S) -> tuple[int, str]:
        """Stop serving a LoRA adapter once its requests finished: (HTTP status, message)."""
        return await self.lora.unload(name, timeout_s)

    def render_metrics(self, ingress_id: str | None = None, families: bytes | None = None) -> bytes:
        """The merged /metrics text; families: the calling ingress's current samples."""
        self.roster.refresh_gauges()
        if ingress_id is not None and families:
            self.aggregator.update(self.metrics_source(ingress_id), decode_families(families))
        return self.aggregator.render(self.metrics.registry)

    def metrics_source(self, ingress_id: str) -> str:
        """The aggregator's key of an ingress's samples of this model."""
        return f"{ingress_id}/{self.model_name}" if self._shared_metrics else ingress_id

    def recent_latency_ms(self, pool: str, since: float | None = None) -> float | None:
        """p90 over the ingresses' recent samples: TTFT for prefill, ITL for decode."""
        return (self.ttft_window if pool == PREFILL else self.itl_window).percentile_ms(90, since)

    def demand_totals(self) -> DemandTotals:
        """The ingresses' cumulative request counters for this model (the sla policy's input)."""
        return self.aggregator.demand_totals(self.model_name)

    def _take_report(self, ingress_id: str, report: IngressReport, now: float) -> None:
        for window, samples in ((self.ttft_window, report.ttft), (self.itl_window, report.itl)):
            for age_s, seconds in samples:
                window.observe(seconds, now - age_s)
        if report.metrics is not None:
            self.aggregator.update(self.metrics_source(ingress_id), report.metrics)

    # ---- scaling (the autoscaler and the driver API call these) ---------------------------
    async def add_replicas(self, pool: str, num: int = 1, count: bool = True) -> list[Replica]:
        """Start replicas, wait until they loaded, then make them routable (and wait, briefly,
        until the ingresses route by the new view). All or nothing: if one fails, every one
        is removed and the error raised. count: raise the pool's target by num."""
        worker_pool = self.pools[pool]
        if count:
            self.targets[pool] += num
        replicas = [worker_pool.start_replica() for _ in range(num)]
        results = await asyncio.gather(*(self.roster.await_ready(r) for r in replicas), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            if count:
                self.targets[pool] -= num
            for r in replicas:
                self.roster.forget(pool, r.replica_id, kill=True)
            raise failed
        addresses = [r for r in results if not isinstance(r, BaseException)]  # all of them: none failed
        for replica, address in zip(replicas, addresses, strict=True):
            self.roster.admit(replica, address)
            self.events.append(PoolEvent(self.clock(), pool, replica.replica_id, "started"))
        await self.wait_applied(self.version, timeout_s=5.0)
        return replicas

    async def drain_replica(self, pool: str, replica_id: str, timeout_s: float = 120.0, replace: bool = False) -> bool:
        """Take a replica out of service once nothing is in flight there (replica_drain.py);
        False: requests were still in flight at the timeout (it is removed anyway)."""
        return await self.replica_drain.drain(pool, replica_id, timeout_s, replace)

    def refilling(self, pool: str, starting: int = 0) -> bool:
        """The pool is below its target or has replicas starting (beyond the autoscaler's own
        `starting`): replacements are under way (the autoscaler holds meanwhile, or it would
        count a dead replica's loss as load)."""
        return self.roster.refilling(pool, starting)

    async def wait_applied(self, version: int, timeout_s: float) -> bool:
        """Wait until every live ingress routes by `version` or later; False at the timeout."""
        deadline = self.clock() + timeout_s
        while not self.ingresses.all_applied(version, self.clock()):
            if self.clock() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def close_idle_pairs(self, max_idle_s: float) -> None:
        """Decode replicas drop process groups idle for max_idle_s; their prefill peers follow,
        closing that epoch only: without it a prefill replica takes the close for the decode
        replica's exit and cancels the prefills of a pair a new request already reopened."""
        for decode in list(self.pools[DECODE].live_replicas()):
            try:
                closed = await asyncio.wait_for(decode.handle.close_idle_pairs.remote(max_idle_s), 30)
            except (TimeoutError, ray.exceptions.RayError):
                continue
            forgets = []
            for prefill_id, epoch in closed:
                prefill = self.pools[PREFILL].get(prefill_id)
                if prefill is not None:
                    forgets.append(prefill.handle.forget_peer.remote(decode.replica_id, epoch))
            # Both sides are closed when this returns (one that died meanwhile has none to close).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*forgets, return_exceptions=True), 30)

    # ---- health and replacement (the parts: replica_health.py) ------------------------------
    async def reconcile_once(self) -> None:
        """Probe every replica, drop the dead, retire silent ingresses, start what is missing."""
        live = [r for pool in self.pools.values() for r in pool.live_replicas()]
        results = await asyncio.gather(*(self.health.probe(r) for r in live))
        if self.state_feed is not None:
            await self.state_feed.retain({r.replica_id for r in live})
        now = self.clock()
        for replica, result in zip(live, results):
            self.health.observe(replica, result, now)
        for ingress_id in self.ingresses.expire(now):
            logger.info("ingress %s went silent; retiring its metrics", ingress_id)
            self.aggregator.retire(self.metrics_source(ingress_id))
        for pool in POOLS:
            self.health.replace_missing(pool, now)
        self.roster.refresh_gauges()
        if now - self._last_idle_sweep > IDLE_PAIR_S / 4:
            self._last_idle_sweep = now
            await self.close_idle_pairs(IDLE_PAIR_S)

    async def _reconcile_forever(self) -> None:
        while True:
            try:
                await self.reconcile_once()
            except Exception:
                logger.exception("controller reconcile failed")
            await asyncio.sleep(self.cfg.controller.probe_interval_s)
