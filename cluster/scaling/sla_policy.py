"""The live `sla` autoscaling policy: both pools sized together, ahead of the load, with the
queue model `splitserve plan` uses (cluster/planning/).

Every interval one SlaPlanner (shared by the two pools' SlaScalingPolicy) forecasts the
arrival rate and lengths at now + planner.startup_s + interval (load_forecast.py), simulates
that load as a Poisson workload on every pool size within min/max_replicas and the GPU budget,
fewest GPUs first, behind the measured backlog (the prompt tokens the replicas report queued,
as that many requests of the forecast's mean lengths waiting at the start: a queue model that
starts empty under-predicts TTFT on a ramp by the wait of the queue already there), at the
larger of the current and the forecast rate (a forecast of falling load does not shrink the
pools before the load has fallen), and takes the first that meets TTFT (prefill.autoscaling.ttft_target_ms)
and ITL (decode.autoscaling.itl_target_ms) at the percentile; none does: the most the bounds
allow. A pool's count is its serving replicas plus those starting. Each pool then moves to
its planned count:
  up    at once, even while earlier starts are in flight (the autoscaler lets this policy
        start the difference then): the lead time is already in the forecast's horizon (a
        replica started now serves when the forecast load arrives); never past the GPU budget
        with the other pool's serving and starting replicas;
  down  only once the plan has stayed below the pool for downscale_delay_s (no flapping), with
        no start in flight, and never while the measured latency (TTFT p90 for prefill, ITL
        p90 for decode) is over its target; drained like any scale-down;
  and where the measured latency is over its target but the plan sees no need, one step up,
  unless a start is in flight (the measurement cannot show it yet): the measurement
  overrides a model that under-predicts.
Every decision's reason carries the forecast and the prediction; they are also exported:
splitserve_planner_predicted_{ttft,itl}_seconds and splitserve_planner_target_replicas{pool}.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.planning.queue_model import Deployment, Prediction, Slo, predict, saturated_pool
from splitserve.cluster.planning.workload import LengthDistribution, PlannedRequest, Workload
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.scaling.load_forecast import DemandTotals, Forecast, LoadForecast
from splitserve.cluster.scaling.policy import MetricsSnapshot, ScalingDecision
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.simulated.simulated_kv_cache import kv_bytes_per_token
from splitserve.engine.simulated.step_time_profile import StepTimeProfile

if TYPE_CHECKING:
    from splitserve.cluster.control.pool_metrics import PoolMetrics

logger = logging.getLogger(__name__)
DemandSource = Callable[[], DemandTotals]


@dataclass(frozen=True)
class Sizing:
    """One plan: replicas per pool, and what the queue model predicts for them."""

    at: float
    forecast: Forecast | None
    targets: dict[str, int]
    prediction: Prediction | None
    meets: bool = False
    queued_requests: int = 0  # the measured backlog the plan was simulated behind

    def describe(self) -> str:
        if self.forecast is None or self.prediction is None:
            return "no finished requests in the window: sized to the minimum"
        p = self.prediction
        meets = "meets the SLOs" if self.meets else "nothing within the bounds meets the SLOs: the most they allow"
        backlog = f", {self.queued_requests} requests queued" if self.queued_requests else ""
        return (
            f"{self.forecast.describe()}{backlog}; plan {self.targets} predicts TTFT {p.ttft_s * 1000:.0f} ms, "
            f"ITL {p.itl_s * 1000:.1f} ms ({meets})"
        )


def sla_kv_bytes_per_token(cfg: ServeConfig, model_dir: str | None) -> int:
    """KV bytes per token of the served model: the profile's, else the checkpoint's config."""
    profile = StepTimeProfile.load(cfg.planner.profile or cfg.engine_profile)
    if profile.kv_bytes_per_token is not None:
        return profile.kv_bytes_per_token
    if model_dir is None:
        raise ValueError(f"profile {profile.name} gives no kv_bytes_per_token and no model directory was given")
    return kv_bytes_per_token(ModelConfig.from_pretrained(model_dir), cfg.dtype)


class SlaPlanner:
    def __init__(
        self,
        cfg: ServeConfig,
        demand: DemandSource,
        kv_bytes_per_token: int,
        metrics: PoolMetrics | None = None,
    ):
        self.cfg = cfg
        self.demand = demand
        self.kv_bytes_per_token = kv_bytes_per_token
        self.metrics = metrics
        self.profile = StepTimeProfile.load(cfg.planner.profile or cfg.engine_profile)
        self.forecast = LoadForecast(cfg.planner.window_s)
        self.slo = Slo(
            cfg.prefill.autoscaling.ttft_target_ms / 1000,
            cfg.decode.autoscaling.itl_target_ms / 1000,
            cfg.planner.percentile,
        )
        self.colocated = cfg.prefill.replicas == 0 and not cfg.prefill.autoscaling.enabled
        self.interval_s = min(p.autoscaling.interval_s for p in (cfg.prefill, cfg.decode))
        self.latest: Sizing | None = None
        self.queued_prompt_tokens: dict[str, int] = {}  # per pool, from its latest snapshot
        self._lock = threading.Lock()

    def gpus_per_replica(self, pool: str) -> float:
        config = self.cfg.prefill if pool == PREFILL else self.cfg.decode
        return config.tensor_parallel_size * max(config.resources.num_gpus, 1.0)

    def observe_backlog(self, pool: str, snapshot: MetricsSnapshot) -> None:
        """The prompt tokens a pool's replicas report queued (each pool's policy, every step)."""
        with self._lock:
            self.queued_prompt_tokens[pool] = sum(load.queued_prefill_tokens for load in snapshot.loads)

    def size(self, now: float, current: dict[str, int]) -> Sizing:
        """The plan for now (computed once per interval, whichever pool asks first). The
        autoscaler calls it in a worker thread before each step, so the simulations never hold
        the controller's event loop; the step's own call then finds it fresh."""
        with self._lock:
            if self.latest is not None and now - self.latest.at < self.interval_s / 2:
                return self.latest
            self.forecast.observe(now, self.demand())
            forecast = self.forecast.estimate(now, self.cfg.planner.startup_s + self.interval_s)
            self.latest = self._plan(now, forecast, current)
            self._export(self.latest)
            return self.latest

    def _counts(self, pool: str, current: int) -> range:
        config = self.cfg.prefill if pool == PREFILL else self.cfg.decode
        scaling = config.autoscaling
        return range(scaling.min_replicas, scaling.max_replicas + 1) if scaling.enabled else range(current, current + 1)

    def _plan(self, now: float, forecast: Forecast | None, current: dict[str, int]) -> Sizing:
        prefill_counts = [0] if self.colocated else list(self._counts(PREFILL, current.get(PREFILL, 0)))
        decode_counts = list(self._counts(DECODE, current.get(DECODE, 1)))
        budget = self.cfg.planner.gpu_budget
        shapes = sorted(
            ((p, d) for p in prefill_counts for d in decode_counts if d >= 1),
            key=lambda pd: (self._gpus(*pd), pd[1], pd[0]),
        )
        within = [pd for pd in shapes if budget is None or self._gpus(*pd) <= budget] or shapes[:1]
        if forecast is None:
            p, d = within[0]
            return Sizing(now, None, {PREFILL: p, DECODE: d}, None)
        workload = self._workload(forecast)
        queued = len(workload.requests) - self.cfg.planner.num_requests
        for p, d in within:
            deployment = self._deployment(p, d)
            if saturated_pool(self.profile, workload, deployment) is not None:
                continue
            prediction = predict(self.profile, workload, deployment, self.slo, self.kv_bytes_per_token)
            if prediction.meets(self.slo):
                return Sizing(now, forecast, {PREFILL: p, DECODE: d}, prediction, meets=True, queued_requests=queued)
        p, d = max(within, key=lambda pd: self._gpus(*pd))  # nothing meets: the most the bounds allow
        prediction = predict(self.profile, workload, self._deployment(p, d), self.slo, self.kv_bytes_per_token)
        return Sizing(now, forecast, {PREFILL: p, DECODE: d}, prediction, meets=False, queued_requests=queued)

    def _workload(self, forecast: Forecast) -> Workload:
        """The forecast load at max(current, forecast) rate, behind the queued backlog."""
        mean_in, mean_out = round(forecast.mean_input_tokens), round(forecast.mean_output_tokens)
        arrivals = Workload.poisson(
            max(forecast.predicted_rate, forecast.rate, 1e-3),
            LengthDistribution(mean_in),
            LengthDistribution(mean_out),
            self.cfg.planner.num_requests,
            seed=0,
        )
        backlog = round(sum(self.queued_prompt_tokens.values()) / max(mean_in, 1))
        if not backlog:
            return arrivals
        waiting = tuple(PlannedRequest(0.0, mean_in, mean_out) for _ in range(backlog))
        return Workload(waiting + arrivals.requests, f"{backlog} queued requests, then {arrivals.description}")

    def within_budget(self, counts: dict[str, int]) -> bool:
        budget = self.cfg.planner.gpu_budget
        return budget is None or self._gpus(counts.get(PREFILL, 0), counts.get(DECODE, 0)) <= budget

    def _gpus(self, prefill: int, decode: int) -> float:
        return prefill * self.gpus_per_replica(PREFILL) + decode * self.gpus_per_replica(DECODE)

    def _deployment(self, prefill: int, decode: int) -> Deployment:
        pool = self.cfg.decode
        return Deployment(
            prefill,
            decode,
            pool.max_num_batched_tokens,
            pool.max_num_seqs,
            self.cfg.prefill.tensor_parallel_size,
            pool.tensor_parallel_size,
        )

    def _export(self, sizing: Sizing) -> None:
        logger.info("sla planner: %s", sizing.describe())
        if self.metrics is None:
            return
        for pool, target in sizing.targets.items():
            self.metrics.planner_target_replicas.labels(pool).set(target)
        if sizing.prediction is not None:
            self.metrics.planner_predicted_ttft.set(sizing.prediction.ttft_s)
            self.metrics.planner_predicted_itl.set(sizing.prediction.itl_s)


class SlaScalingPolicy:
    """One pool's side of the shared plan, with the autoscaler's policy interface (decide,
    mark_scaled, cfg)."""

    def __init__(self, pool: str, planner: SlaPlanner, cluster_counts: Callable[[], dict[str, int]]):
        self.pool = pool
        self.planner = planner
        self.cluster_counts = cluster_counts
        config = planner.cfg.prefill if pool == PREFILL else planner.cfg.decode
        self.cfg = config.autoscaling
        self._below_since: float | None = None

    def mark_scaled(self, now: float) -> None:
        self._below_since = None

    def decide(self, snapshot: MetricsSnapshot, now: float) -> ScalingDecision:
        starting, cfg = snapshot.starting_replicas, self.cfg
        n = snapshot.num_replicas + starting
        counts = {**self.cluster_counts(), self.pool: n}
        self.planner.observe_backlog(self.pool, snapshot)
        sizing = self.planner.size(now, counts)
        target = min(max(sizing.targets[self.pool], cfg.min_replicas), cfg.max_replicas)
        # The plan's two counts fit the budget together, but the other pool may still hold
        # more than its plan (waiting out its downscale delay): start only what fits.
        while target > n and not self.planner.within_budget({**counts, self.pool: target}):
            target -= 1
        measured = snapshot.ttft_p90_ms if self.pool == PREFILL else snapshot.itl_p90_ms
        limit = self.planner.slo.ttft_s if self.pool == PREFILL else self.planner.slo.itl_s
        breached = measured is not None and measured / 1000 > limit
        reason = sizing.describe()
        if starting:
            reason += f"; {starting} replica(s) starting"
        if breached and target <= n and n < cfg.max_replicas and not starting:
            stepped = min(n + cfg.step, cfg.max_replicas)
            if self.planner.within_budget({**counts, self.pool: stepped}):
                target = stepped
                reason += f"; measured p90 {measured:.0f} ms over the {limit * 1000:.0f} ms target: one step up"
            else:
                reason += f"; measured p90 {measured:.0f} ms over the {limit * 1000:.0f} ms target, at the GPU budget"
        if target > n:
            self._below_since = None
            return ScalingDecision("up", target, reason)
        if starting:  # no scale-down before the starts a plan asked for serve
            self._below_since = None
            return ScalingDecision("hold", n, reason)
        busy = any(load.num_running or load.num_waiting for load in snapshot.loads)
        if target < n and sizing.forecast is None and busy:
            # Requests run but none finished in the window (a stall, or very long requests):
            # no forecast is not no load.
            self._below_since = None
            return ScalingDecision("hold", n, f"{reason}; requests in flight: no scale-down without a forecast")
        if target < n and not breached:
            self._below_since = now if self._below_since is None else self._below_since
            if now - self._below_since >= cfg.downscale_delay_s:
                self._below_since = None
                return ScalingDecision("down", target, reason)
            return ScalingDecision("hold", n, f"{reason}; below {n} for {now - self._below_since:.1f} s")
        self._below_since = None
        return ScalingDecision("hold", n, reason)
