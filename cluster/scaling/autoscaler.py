"""Autoscaler: one control loop per autoscaled pool, in the controller (the process that
owns the pools).

Every interval_s it builds a MetricsSnapshot of the pool from a load view (`cluster.loads`:
the controller's probes of every replica, or a router's view in the driver API) and recent
latencies (TTFT for prefill, ITL for decode, as the ingresses measured them), asks the
pool's policy, and executes the decision:

  up    cluster.add_replicas: the new actors ask Ray for the pool's resources (a pending
        num_gpus / custom-resource request is what Ray's autoscaler adds nodes for), load,
        and become routable (each ingress indexes their snapshot first).
  down  cluster.drain_replica on the least-loaded replicas: no new requests, in-flight
        ones finish, the replica leaves every ingress's routing, actor removed; its Ray
        resources are freed, so Ray's autoscaler can later remove the idle node.

One action per pool is in flight at a time, with one exception: the `sla` policy may start
more replicas while its earlier starts are in flight (its plan is a target count of serving +
starting replicas, not a step, so each interval it starts the difference at once rather than
waiting out a start-up time per move). The reactive policies keep one action at a time: each
step is their answer to a measurement that cannot show a start in flight, so stepping again
before it serves would compound. A scale-down never overlaps another action of its pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.cluster.bounded_log import BoundedLog
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.scaling.cluster_view import ScalableCluster
from splitserve.cluster.scaling.policy import (
    DecodeScalingPolicy,
    MetricsSnapshot,
    PoolScalingPolicy,
    PrefillScalingPolicy,
    ScalingDecision,
)
from splitserve.cluster.scaling.sla_policy import DemandSource, SlaPlanner, SlaScalingPolicy, sla_kv_bytes_per_token

if TYPE_CHECKING:
    from splitserve.cluster.control.pool_metrics import PoolMetrics

logger = logging.getLogger(__name__)
EVENT_LOG_SIZE = 1024  # the newest scaling actions kept in Autoscaler.events

# (pool, since) -> recent p90 latency in ms of that pool (TTFT for prefill, ITL for decode),
# counting only samples after `since` (monotonic s; None: the whole window); None: no samples.
LatencySource = Callable[[str, "float | None"], "float | None"]


@dataclass
class ScalingEvent:
    """A scaling action the autoscaler started (kept in Autoscaler.events, newest last)."""

    at: float  # monotonic seconds: when it was decided
    pool: str
    action: str  # "up" | "down"
    from_replicas: int
    to_replicas: int
    reason: str
    finished_at: float | None = None  # replicas ready and routed to / drained and removed
    ok: bool | None = None  # False: a replica failed to start or to drain in time

    @property
    def num(self) -> int:
        return abs(self.to_replicas - self.from_replicas)


@dataclass
class _Action:
    event: ScalingEvent
    task: asyncio.Task


class Autoscaler:
    def __init__(
        self,
        cluster: ScalableCluster,  # the Controller, or DisaggCluster
        cfg: ServeConfig,
        metrics: PoolMetrics | None = None,
        latency_source: LatencySource | None = None,
        drain_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        demand_source: DemandSource | None = None,
        model_dir: str | None = None,
    ):
        """demand_source, model_dir: the ingresses' request counters and the checkpoint (its KV
        bytes per token), which the `sla` policy sizes from."""
        self.cluster = cluster
        self.cfg = cfg
        self.metrics = metrics
        self.latency_source = latency_source
        # A request may run up to request_timeout_s, so a drain waits at most that long.
        self.drain_timeout_s = cfg.request_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.clock = clock
        self.policies: dict[str, PoolScalingPolicy | SlaScalingPolicy] = {}
        if "sla" in (cfg.prefill.autoscaling.policy, cfg.decode.autoscaling.policy):
            if demand_source is None:
                raise ValueError("autoscaling.policy sla needs the ingresses' request counters (a demand source)")
            planner = SlaPlanner(cfg, demand_source, sla_kv_bytes_per_token(cfg, model_dir), metrics)
            for pool in (PREFILL, DECODE):
                if (cfg.prefill if pool == PREFILL else cfg.decode).autoscaling.enabled:
                    self.policies[pool] = SlaScalingPolicy(pool, planner, self._planned_counts)
        else:
            if cfg.prefill.autoscaling.enabled:
                self.policies[PREFILL] = PrefillScalingPolicy(cfg.prefill.autoscaling)
            if cfg.decode.autoscaling.enabled:
                self.policies[DECODE] = DecodeScalingPolicy(cfg.decode.autoscaling)
        self.events: BoundedLog[ScalingEvent] = BoundedLog(EVENT_LOG_SIZE)
        self.last_decisions: dict[str, ScalingDecision] = {}
        self._last_scaled_at: dict[str, float | None] = {pool: None for pool in self.policies}
        self._actions: dict[str, list[_Action]] = {pool: [] for pool in self.policies}
        self._loops: list[asyncio.Task] = []

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._loops:
            return
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._run_pool(pool), name=f"autoscaler-{pool}") for pool in self.policies]
        for pool, policy in self.policies.items():
            c = policy.cfg
            logger.info(
                "autoscaling %s: %d..%d replicas, step %d, up after %.1f s, down after %.1f s",
                pool,
                c.min_replicas,
                c.max_replicas,
                c.step,
                c.upscale_delay_s,
                c.downscale_delay_s,
            )

    async def stop(self) -> None:
        tasks = self._loops + [a.task for actions in self._actions.values() for a in actions]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loops = []
        for actions in self._actions.values():
            actions.clear()

    def starting(self, pool: str) -> int:
        """Replicas this autoscaler asked for in the pool that do not serve yet."""
        return sum(a.event.num for a in self._actions.get(pool, ()) if a.event.action == "up")

    def _planned_counts(self) -> dict[str, int]:
        """Per pool, serving replicas plus those starting: what the `sla` plan's counts mean
        (a replica starting holds its GPUs, and counts toward the budget)."""
        view = self.cluster.loads
        return {
            pool: len(view.replica_ids(pool, include_draining=False)) + self.starting(pool)
            for pool in (PREFILL, DECODE)
        }

    def scaling_in_progress(self, pool: str) -> bool:
        return any(not a.task.done() for a in self._actions.get(pool, ()))

    def _may_decide(self, pool: str) -> bool:
        """Nothing in flight, or (the `sla` policy) only starts: it may start more."""
        actions = self._actions.get(pool, [])
        if not actions:
            return True
        return isinstance(self.policies[pool], SlaScalingPolicy) and all(a.event.action == "up" for a in actions)

    # ---- one control step ----------------------------------------------------------------
    async def _run_pool(self, pool: str) -> None:
        interval = self.policies[pool].cfg.interval_s
        policy = self.policies[pool]
        while True:
            try:
                if isinstance(policy, SlaScalingPolicy) and self._may_decide(pool):
                    await asyncio.to_thread(policy.planner.size, self.clock(), self._planned_counts())
                self.step(pool)
            except Exception:
                logger.exception("autoscaler step for %s failed", pool)
            await asyncio.sleep(interval)

    def snapshot(self, pool: str, now: float | None = None) -> MetricsSnapshot:
        now = self.clock() if now is None else now
        view = self.cluster.loads
        loads = [view.load(pool, rid) for rid in view.replica_ids(pool, include_draining=False)]
        since = self._last_scaled_at.get(pool)
        latency = self.latency_source(pool, since) if self.latency_source is not None else None
        return MetricsSnapshot(
            taken_at=min((l.updated_at for l in loads), default=now),
            num_replicas=len(loads),
            loads=tuple(l.report for l in loads),
            ttft_p90_ms=latency if pool == PREFILL else None,
            itl_p90_ms=latency if pool == DECODE else None,
            starting_replicas=self.starting(pool),
        )

    def step(self, pool: str) -> ScalingDecision | None:
        """Decide once for `pool` and start the action; None while an action is in flight
        (for the `sla` policy: while a drain is) or the controller is replacing lost replicas
        (their absence is not load)."""
        self._set_replica_gauge(pool)
        if not self._may_decide(pool) or self.cluster.refilling(pool, self.starting(pool)):
            return None
        now = self.clock()
        snap = self.snapshot(pool, now)
        decision = self.policies[pool].decide(snap, now)
        self.last_decisions[pool] = decision
        if self.metrics is not None:
            self.metrics.scaling_decisions.labels(pool, decision.action).inc()
        if decision.action == "hold" or (decision.action == "down" and snap.starting_replicas):
            logger.debug("autoscaler %s: hold at %d (%s)", pool, snap.num_replicas, decision.reason)
            return decision
        cfg = self.policies[pool].cfg
        target = min(max(decision.target_replicas, cfg.min_replicas), cfg.max_replicas)
        current = snap.num_replicas + snap.starting_replicas  # a scale-down has none starting
        if (target - current) * (1 if decision.action == "up" else -1) <= 0:
            return decision
        logger.info("autoscaler %s: scale %s %d -> %d (%s)", pool, decision.action, current, target, decision.reason)
        event = ScalingEvent(now, pool, decision.action, current, target, decision.reason)
        self.events.append(event)
        action = self._scale_up if decision.action == "up" else self._scale_down
        task = asyncio.get_running_loop().create_task(action(pool, event), name=f"scale-{pool}")
        self._actions[pool].append(_Action(event, task))
        return decision

    # ---- actions -------------------------------------------------------------------------
    async def _scale_up(self, pool: str, event: ScalingEvent) -> None:
        ok, num = False, event.num
        try:
            replicas = await self.cluster.add_replicas(pool, num)
            logger.info("autoscaler %s: added %s", pool, ", ".join(r.replica_id for r in replicas))
            ok = True
        except Exception:
            logger.exception("autoscaler %s: adding %d replica(s) failed", pool, num)
        finally:
            self._finish_action(pool, event, ok)

    async def _scale_down(self, pool: str, event: ScalingEvent) -> None:
        ok = False
        try:
            victims = self._least_loaded(pool, event.num, self.policies[pool].cfg.min_replicas)
            results = await asyncio.gather(
                *(self.cluster.drain_replica(pool, rid, self.drain_timeout_s) for rid in victims),
                return_exceptions=True,
            )
            for rid, result in zip(victims, results):
                if isinstance(result, BaseException):
                    logger.error("autoscaler %s: draining %s failed: %r", pool, rid, result)
                elif not result:
                    logger.warning(
                        "autoscaler %s: %s still had requests after %.0f s; removed anyway",
                        pool,
                        rid,
                        self.drain_timeout_s,
                    )
                else:
                    logger.info("autoscaler %s: drained and removed %s", pool, rid)
            ok = all(result is True for result in results)
        finally:
            self._finish_action(pool, event, ok)

    def _least_loaded(self, pool: str, num: int, min_replicas: int) -> list[str]:
        """Up to num serving replicas that are quickest to drain, never leaving fewer than
        min_replicas serving."""
        view = self.cluster.loads
        ids = view.replica_ids(pool, include_draining=False)
        num = min(num, len(ids) - min_replicas)
        if num <= 0:
            return []

        def drain_cost(rid) -> tuple:
            load = view.load(pool, rid)
            return (
                load.report.num_running + load.report.num_waiting + load.pending_requests,
                load.effective_queued_tokens,
                load.report.kv_usage,
            )

        return sorted(ids, key=drain_cost)[:num]

    def _finish_action(self, pool: str, event: ScalingEvent, ok: bool) -> None:
        now = self.clock()
        event.finished_at, event.ok = now, ok
        self._actions[pool] = [a for a in self._actions[pool] if a.event is not event]
        self._last_scaled_at[pool] = now
        self.policies[pool].mark_scaled(now)  # the cooldown starts once the change is done
        self._set_replica_gauge(pool)

    def _set_replica_gauge(self, pool: str) -> None:
        if self.metrics is not None:
            self.metrics.replicas.labels(pool).set(len(self.cluster.loads.replica_ids(pool)))
