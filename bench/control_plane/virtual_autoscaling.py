"""The controller's autoscaler driving the virtual-time cluster: the real `Autoscaler`
(cluster/scaling/autoscaler.py) with the policies it builds from a ServeConfig (the reactive
pools' policies, or the shared `sla` planner), fed what the controller feeds it live, on the
simulated clock:

  loads          each routable replica's LoadReport, read from its engine as a poll reports it
                 (queued prompt tokens, running and waiting requests, KV usage; a decode
                 replica's running count covers every request routed to it), fresh every step;
  latency        the controller's LatencyWindows (10 s, p90) of the TTFT and ITL samples the
                 ingresses observe: TTFT when the first token reaches the client (so the queue
                 wait is in it), every inter-token gap;
  demand         the ingresses' counters the sla policy forecasts from: prompt tokens received
                 at arrival, finished requests with their prompt and generated tokens.

`add_replicas` starts simulated replicas that become routable `startup_s` later (the
autoscaler's action is in flight meanwhile, as live); `drain_replica` drains one (no new
requests; removed once its last request is done: none is lost). Each pool is stepped every
its own interval_s; a pool whose autoscaling is off keeps its replicas (a static deployment).
Everything is deterministic: no wall clock, no threads; the actions' asyncio tasks run on one
event loop that the driver lets settle after every step and every replica ready or removed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from splitserve.bench.control_plane.virtual_time_cluster import MeasuredRequest, Replica, VirtualTimeCluster
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.planning.workload import Workload
from splitserve.cluster.routing.load import LoadReport, ReplicaLoad
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.scaling.autoscaler import Autoscaler, ScalingEvent
from splitserve.cluster.scaling.latency_window import LatencyWindow
from splitserve.cluster.scaling.load_forecast import DemandTotals
from splitserve.cluster.scaling.sla_policy import Sizing, SlaScalingPolicy

SETTLE_YIELDS = 20  # event-loop turns after a step or a replica change: an action's task chain is a few deep


class VirtualControlPlane:
    """What the Controller is to the autoscaler (ScalableCluster, LoadView, latency and
    demand sources), over a VirtualTimeCluster."""

    def __init__(self, cluster: VirtualTimeCluster, startup_s: float):
        self.cluster = cluster
        self.startup_s = startup_s
        self.ttft_window, self.itl_window = LatencyWindow(), LatencyWindow()
        self._finished = [0, 0, 0]  # requests, their prompt tokens, their generated tokens
        self._waiting: dict[str, asyncio.Future] = {}  # replica id -> its start or drain
        cluster.on_tokens = self._observe

    # ---- ScalableCluster / LoadView ------------------------------------------------------
    @property
    def loads(self) -> VirtualControlPlane:
        return self

    def replica_ids(self, pool: str, include_draining: bool = True) -> list[str]:
        now = self.cluster.now
        return [
            r.replica_id for r in self.cluster.pools[pool] if r.ready_at <= now and (include_draining or not r.draining)
        ]

    def load(self, pool: str, replica_id: str) -> ReplicaLoad:
        replica = self._replica(pool, replica_id)
        scheduler = replica.engine.scheduler
        running = len(scheduler.running) if pool == PREFILL else max(len(scheduler.running), replica.in_flight)
        report = LoadReport(scheduler.num_waiting_tokens, running, replica.engine.kv.usage, len(scheduler.waiting))
        return ReplicaLoad(replica_id, report, draining=replica.draining, updated_at=self.cluster.now)

    def refilling(self, pool: str, starting: int = 0) -> bool:
        return False

    async def add_replicas(self, pool: str, num: int = 1) -> list[Replica]:
        replicas = [self.cluster.add_replica(pool, self.startup_s) for _ in range(num)]
        await asyncio.gather(*(self._wait_for(r) for r in replicas))
        return replicas

    async def drain_replica(self, pool: str, replica_id: str, timeout_s: float = 120.0) -> bool:
        """Waits for every request on it however long (the virtual clock has no request timeout)."""
        replica = self._replica(pool, replica_id)
        if not self.cluster.drain(replica):
            await self._wait_for(replica)
        return True

    # ---- the ingresses' observations -----------------------------------------------------
    def latency_ms(self, pool: str, since: float | None) -> float | None:
        window = self.ttft_window if pool == PREFILL else self.itl_window
        return window.percentile_ms(90, since, now=self.cluster.now)

    def demand(self) -> DemandTotals:
        arrived = sum(r.input_tokens for r in self.cluster.requests if r.arrival_s <= self.cluster.now)
        return DemandTotals(float(arrived), *map(float, self._finished))

    def _observe(self, request: MeasuredRequest, count: int) -> None:
        times = request.token_times
        first = len(times) - count
        if first == 0:
            self.ttft_window.observe(request.ttft_s, now=times[0])
        for i in range(max(first, 1), len(times)):
            self.itl_window.observe(times[i] - times[i - 1], now=times[i])
        if request.finished:
            self._finished[0] += 1
            self._finished[1] += request.input_tokens
            self._finished[2] += request.output_tokens

    # ---- replica lifecycle ---------------------------------------------------------------
    def _replica(self, pool: str, replica_id: str) -> Replica:
        return next(r for r in self.cluster.pools[pool] if r.replica_id == replica_id)

    def _wait_for(self, replica: Replica) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._waiting[replica.replica_id] = future
        return future

    def changed(self, replicas: list[Replica]) -> None:
        for replica in replicas:
            future = self._waiting.pop(replica.replica_id, None)
            if future is not None:
                future.set_result(None)

    @property
    def finished_requests(self) -> int:
        return self._finished[0]

    def waiting_pools(self) -> set[str]:
        return {replica_id.split("-")[0] for replica_id in self._waiting}


@dataclass
class Sample:
    at: float
    serving: dict[str, int]  # routable, not draining
    provisioned: dict[str, int]  # starting, serving or draining: what holds GPUs
    draining: dict[str, int]


@dataclass
class AutoscaledRun:
    requests: list[MeasuredRequest]
    samples: list[Sample]
    events: list[ScalingEvent]
    sizings: list[Sizing] = field(default_factory=list)  # the sla planner's, one per interval
    gpu_seconds: float = 0.0  # provisioned, over [0, the workload's last arrival]
    removed: list[Replica] = field(default_factory=list)


def run_autoscaled(
    cfg: ServeConfig,
    cluster: VirtualTimeCluster,
    workload: Workload,
    initial: dict[str, int],
    startup_s: float,
    sample_s: float = 1.0,
) -> AutoscaledRun:
    """Serve the workload from `initial` replicas per pool, the autoscaler stepping each
    autoscaled pool every its interval_s; runs until every request has finished."""
    return asyncio.run(_drive(cfg, cluster, workload, initial, startup_s, sample_s))


async def _drive(
    cfg: ServeConfig, cluster: VirtualTimeCluster, workload: Workload, initial: dict, startup_s: float, sample_s: float
) -> AutoscaledRun:
    plane = VirtualControlPlane(cluster, startup_s)
    for pool, count in initial.items():
        for _ in range(count):
            cluster.add_replica(pool)
    for request in workload.requests:
        cluster.submit(request)
    autoscaler = Autoscaler(
        plane,  # type: ignore[arg-type]  # a ScalableCluster structurally; the Protocol's ids are Any
        cfg,
        latency_source=plane.latency_ms,
        clock=lambda: cluster.now,
        demand_source=plane.demand,
    )
    gpus = {pool: _gpus_per_replica(cfg, pool) for pool in (PREFILL, DECODE)}
    end = workload.requests[-1].arrival_s
    run = AutoscaledRun(cluster.requests, [], [])
    next_step = {pool: 0.0 for pool in autoscaler.policies}
    tick, gpu_seconds_at_end = 0.0, None
    while cluster.busy() or plane.finished_requests < len(cluster.requests):
        if gpu_seconds_at_end is None and tick >= end:
            await _run_until(cluster, end, autoscaler, plane)
            gpu_seconds_at_end = cluster.gpu_seconds(gpus)
        await _run_until(cluster, tick, autoscaler, plane)
        for pool, policy in autoscaler.policies.items():
            if tick >= next_step[pool]:
                next_step[pool] = tick + policy.cfg.interval_s
                autoscaler.step(pool)
                sizing = policy.planner.latest if isinstance(policy, SlaScalingPolicy) else None
                if sizing is not None and (not run.sizings or run.sizings[-1] is not sizing):
                    run.sizings.append(sizing)
        await _settle(autoscaler, plane)
        draining = {pool: sum(r.draining for r in replicas) for pool, replicas in cluster.pools.items()}
        run.samples.append(Sample(tick, _counts(cluster, serving=True), _counts(cluster, serving=False), draining))
        tick += sample_s
    await autoscaler.stop()
    run.events = list(autoscaler.events)
    run.gpu_seconds = cluster.gpu_seconds(gpus) if gpu_seconds_at_end is None else gpu_seconds_at_end
    run.removed = list(cluster.removed)
    return run


async def _run_until(cluster: VirtualTimeCluster, until: float, autoscaler: Autoscaler, plane: VirtualControlPlane):
    while changed := cluster.run_until(until):
        plane.changed(changed)
        await _settle(autoscaler, plane)


async def _settle(autoscaler: Autoscaler, plane: VirtualControlPlane) -> None:
    """Let the actions' tasks run until each waits on a replica start or drain again."""
    for _ in range(SETTLE_YIELDS):
        await asyncio.sleep(0)
    stuck = {p for p in autoscaler.policies if autoscaler.scaling_in_progress(p)} - plane.waiting_pools()
    if stuck:
        raise RuntimeError(f"the autoscaler's action on {sorted(stuck)} did not settle in {SETTLE_YIELDS} turns")


def _counts(cluster: VirtualTimeCluster, serving: bool) -> dict[str, int]:
    now = cluster.now
    return {
        pool: sum(1 for r in replicas if not serving or (r.ready_at <= now and not r.draining))
        for pool, replicas in cluster.pools.items()
    }


def _gpus_per_replica(cfg: ServeConfig, pool: str) -> float:
    config = cfg.prefill if pool == PREFILL else cfg.decode
    return config.tensor_parallel_size * max(config.resources.num_gpus, 1.0)
