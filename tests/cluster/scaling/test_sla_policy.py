"""The live `sla` autoscaling policy, pure (no Ray), on a virtual clock: the forecast follows a
ramp; both pools are sized ahead of a rising load so the deployment serving at every moment
is one the queue model says meets the SLOs at that moment's load (replicas take startup_s to
serve); a flat load draws no actions; the GPU budget and the bounds hold; a measured latency
over its target steps a pool up; bad configurations are one-line errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.metrics_aggregator import MetricsAggregator
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.planning.queue_model import predict
from splitserve.cluster.planning.workload import LengthDistribution, Workload
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.scaling.load_forecast import DemandTotals, LoadForecast
from splitserve.cluster.scaling.policy import MetricsSnapshot
from splitserve.cluster.scaling.sla_policy import SlaPlanner, SlaScalingPolicy
from splitserve.proto.messages.ingress_report import families_of

INPUT, OUTPUT, STARTUP_S = 2048, 256, 20.0


def serve_config(gpu_budget: int | None = None, prefill_max: int = 6, decode_max: int = 6) -> ServeConfig:
    scaling = {"enabled": True, "policy": "sla", "min_replicas": 1, "interval_s": 1.0, "downscale_delay_s": 30}
    return ServeConfig.model_validate(
        {
            "engine": "simulated",
            "engine_profile": "llama-8b-h200",
            "prefill": {"autoscaling": {**scaling, "max_replicas": prefill_max, "ttft_target_ms": 500}},
            "decode": {"autoscaling": {**scaling, "max_replicas": decode_max, "itl_target_ms": 25}},
            "planner": {"gpu_budget": gpu_budget, "startup_s": STARTUP_S, "window_s": 10, "num_requests": 200},
        }
    )


class VirtualLoad:
    """Counters of a load at rate(t) req/s, every request INPUT in and OUTPUT out (finished as
    they arrive: the lag is not what is under test)."""

    def __init__(self, rate):
        self.rate, self.now, self.requests = rate, 0.0, 0.0

    def advance(self, dt: float) -> None:
        self.requests += self.rate(self.now + dt / 2) * dt
        self.now += dt

    def totals(self) -> DemandTotals:
        return DemandTotals(self.requests * INPUT, self.requests, self.requests * INPUT, self.requests * OUTPUT)


def run(cfg: ServeConfig, load: VirtualLoad, seconds: int, start: dict[str, int], breach_ms: float | None = None):
    """Step the two policies once a second; a scale-up serves STARTUP_S later, a scale-down at
    once. Returns the serving counts per second and the actions taken."""
    serving, starting = dict(start), []  # starting: (ready at, pool, count)
    planner = SlaPlanner(cfg, load.totals, kv_bytes_per_token=131072)

    def planned() -> dict[str, int]:  # serving + starting, as the autoscaler counts them
        return {pool: serving[pool] + sum(s[2] for s in starting if s[1] == pool) for pool in serving}

    policies = {pool: SlaScalingPolicy(pool, planner, planned) for pool in (PREFILL, DECODE)}
    history, actions = [], []
    for _ in range(seconds):
        load.advance(1.0)
        now = load.now
        for ready in [s for s in starting if s[0] <= now]:
            serving[ready[1]] += ready[2]
            starting.remove(ready)
        for pool, policy in policies.items():
            pending = sum(s[2] for s in starting if s[1] == pool)
            itl = breach_ms if pool == DECODE else None
            snapshot = MetricsSnapshot(now, serving[pool], itl_p90_ms=itl, starting_replicas=pending)
            decision = policy.decide(snapshot, now)
            if decision.action == "up":
                starting.append((now + STARTUP_S, pool, decision.target_replicas - serving[pool] - pending))
            elif decision.action == "down":
                serving[pool] = decision.target_replicas
            if decision.action != "hold":
                actions.append((now, pool, decision.action, decision.target_replicas))
                policy.mark_scaled(now)
        history.append((now, dict(serving), planner))
    return history, actions


def meets_at(cfg: ServeConfig, planner: SlaPlanner, counts: dict[str, int], rate: float) -> bool:
    workload = Workload.poisson(rate, LengthDistribution(INPUT), LengthDistribution(OUTPUT), 200, seed=0)
    deployment = planner._deployment(counts[PREFILL], counts[DECODE])
    return predict(planner.profile, workload, deployment, planner.slo, 131072).meets(planner.slo)


def test_the_forecast_follows_a_ramp_and_needs_finished_requests():
    load, forecast = VirtualLoad(lambda t: 2 + 0.2 * t), LoadForecast(window_s=10)
    assert forecast.estimate(0, 20) is None
    for _ in range(60):
        load.advance(1.0)
        forecast.observe(load.now, load.totals())
    estimate = forecast.estimate(load.now, horizon_s=20)
    assert estimate.mean_input_tokens == pytest.approx(INPUT) and estimate.mean_output_tokens == pytest.approx(OUTPUT)
    assert estimate.rate == pytest.approx(2 + 0.2 * 55, rel=0.02)  # the last window's mean
    assert estimate.predicted_rate == pytest.approx(2 + 0.2 * 80, rel=0.02)  # 20 s ahead, on the line
    idle = LoadForecast(window_s=10)
    for t in range(30):
        idle.observe(float(t), DemandTotals(0, 0, 0, 0))
    assert idle.estimate(29.0, 20) is None  # nothing finished: no lengths, no forecast


def test_a_rising_load_is_served_by_a_deployment_that_meets_the_slos_before_it_arrives():
    """4 -> 28 req/s over 120 s, replicas serving 20 s after they are asked for: from the
    second window on (a trend needs two), the deployment serving at every second meets both
    SLOs at that second's load, by the planner's own queue model (its workload seed and size:
    the model's accuracy is tests/cluster/planning/'s). A planner that ignored the start-up
    time (startup_s 0) lags the same ramp."""
    cfg = serve_config()
    rate = lambda t: min(4 + 0.2 * t, 28.0)  # noqa: E731
    history, actions = run(cfg, VirtualLoad(rate), 150, {PREFILL: 1, DECODE: 1})
    assert any(a[2] == "up" for a in actions)
    for now, counts, planner in history[19:]:
        assert meets_at(cfg, planner, counts, rate(now)), (now, counts, rate(now))
    lagging = cfg.model_copy(update={"planner": cfg.planner.model_copy(update={"startup_s": 0.0})})
    history, _ = run(lagging, VirtualLoad(rate), 150, {PREFILL: 1, DECODE: 1})
    assert not all(meets_at(cfg, planner, counts, rate(now)) for now, counts, planner in history[19:])


def test_a_flat_load_draws_no_actions_once_sized():
    cfg = serve_config()
    history, actions = run(cfg, VirtualLoad(lambda t: 16.0), 240, {PREFILL: 1, DECODE: 1})
    assert actions and all(now < 60 for now, *_ in actions), actions  # sized within a minute, then steady
    assert history[-1][1] == history[60][1]


def test_the_gpu_budget_and_the_bounds_hold_and_a_falling_load_scales_down():
    cfg = serve_config(gpu_budget=3, prefill_max=2, decode_max=2)
    rate = lambda t: 40.0 if t < 100 else 1.0  # noqa: E731  (more than 3 GPUs can serve, then little)
    history, actions = run(cfg, VirtualLoad(rate), 200, {PREFILL: 1, DECODE: 1})
    assert all(counts[PREFILL] + counts[DECODE] <= 3 for _, counts, _ in history)
    assert all(1 <= counts[pool] <= 2 for _, counts, _ in history for pool in (PREFILL, DECODE))
    assert max(c[PREFILL] + c[DECODE] for _, c, _ in history) == 3
    assert history[-1][1] == {PREFILL: 1, DECODE: 1}  # down through the delay, once the load fell
    assert any(a[2] == "down" for a in actions)


def test_a_measured_latency_over_target_steps_up_where_the_plan_would_hold():
    cfg = serve_config()
    _, calm = run(cfg, VirtualLoad(lambda t: 1.0), 40, {PREFILL: 1, DECODE: 1})
    _, breached = run(cfg, VirtualLoad(lambda t: 1.0), 40, {PREFILL: 1, DECODE: 1}, breach_ms=80.0)
    assert not [a for a in calm if a[2] == "up"]
    assert [a for a in breached if a[1] == DECODE and a[2] == "up"]


def test_bad_configurations_are_one_line_errors():
    scaling = {"enabled": True, "policy": "sla", "max_replicas": 2}
    with pytest.raises(ValueError, match="set it on every autoscaled pool"):
        ServeConfig.model_validate({"decode": {"autoscaling": scaling}, "prefill": {"autoscaling": {"enabled": True}}})
    with pytest.raises(ValueError, match="planner.profile: .*neither a file nor a shipped one"):
        ServeConfig.model_validate({"decode": {"autoscaling": scaling}, "planner": {"profile": "no-such"}})
    with pytest.raises(ValueError, match="planner.profile: .*no figures for tensor_parallel_size 2"):
        ServeConfig.model_validate({"decode": {"autoscaling": scaling, "tensor_parallel_size": 2}})


def test_the_demand_is_every_ingress_counters_for_its_own_model():
    """Two ingresses' real metric registries, as the controller's aggregator holds them: the
    sla policy's counters add up over both, count one model only, and survive an ingress gone."""
    aggregator = MetricsAggregator()
    for ingress, (prompt, output) in {"a": (100, 7), "b": (300, 9)}.items():
        metrics = Metrics("m")
        metrics.prompt_tokens.inc(prompt + 50)  # 50 tokens of a request still running
        metrics.observe_finished("length", prompt, output)
        other = Metrics("other-model")
        other.prompt_tokens.inc(1000)
        other.observe_finished("stop", 1000, 1)
        # A shared aggregator keeps each model's samples of an ingress apart (Controller.metrics_source).
        aggregator.update(f"{ingress}/m", families_of(metrics.registry))
        aggregator.update(f"{ingress}/other-model", families_of(other.registry))
    totals = aggregator.demand_totals("m")
    assert totals == DemandTotals(500, 2, 400, 16)
    aggregator.retire("a/m")
    assert aggregator.demand_totals("m") == totals


def test_no_scale_down_without_a_forecast_while_requests_run():
    """Nothing finished in the window (a stall, or very long requests) while the replicas hold
    running requests: the plan falls to the minimum, but the pool holds."""
    from splitserve.cluster.routing.load import LoadReport

    cfg = serve_config()
    planner = SlaPlanner(cfg, lambda: DemandTotals(0, 0, 0, 0), kv_bytes_per_token=131072)
    policy = SlaScalingPolicy(DECODE, planner, lambda: {PREFILL: 1, DECODE: 3})
    busy = MetricsSnapshot(0.0, 3, loads=(LoadReport(num_running=4),) * 3)
    idle = MetricsSnapshot(0.0, 3, loads=(LoadReport(),) * 3)
    for t in range(120):
        assert policy.decide(MetricsSnapshot(float(t), 3, busy.loads), float(t)).action == "hold"
    downs = [
        (t, d)
        for t in range(120, 200)
        if (d := policy.decide(MetricsSnapshot(float(t), 3, idle.loads), float(t))).action == "down"
    ]
    assert downs and downs[0][1].target_replicas == 1
    assert downs[0][0] == 120 + cfg.decode.autoscaling.downscale_delay_s  # idle: down after the delay


def test_a_measured_latency_over_target_steps_up_only_within_the_gpu_budget():
    """At the budget, a latency over its target does not buy a GPU the budget does not have
    (found by the bursty-trace benchmark: the step up went past the budget)."""
    _, breached = run(serve_config(gpu_budget=2), VirtualLoad(lambda t: 1.0), 40, {PREFILL: 1, DECODE: 1}, 80.0)
    assert not [a for a in breached if a[2] == "up"]
    _, roomy = run(serve_config(gpu_budget=3), VirtualLoad(lambda t: 1.0), 40, {PREFILL: 1, DECODE: 1}, 80.0)
    assert [a for a in roomy if a[1] == DECODE and a[2] == "up"]


def flat_planner(rate: float) -> tuple[SlaPlanner, VirtualLoad]:
    load = VirtualLoad(lambda t: rate)
    planner = SlaPlanner(serve_config(), load.totals, kv_bytes_per_token=131072)
    for _ in range(30):
        load.advance(1.0)
        planner.forecast.observe(load.now, load.totals())
    return planner, load


def test_the_plan_is_simulated_behind_the_measured_backlog():
    """The same forecast load, once with the prefill replicas reporting 200 prompts queued:
    the plan behind the backlog holds more prefill replicas, and says why. A queue model that
    starts empty would size both alike (the under-prediction the bursty benchmark measured)."""
    planner, load = flat_planner(4.0)
    counts = {PREFILL: 1, DECODE: 1}
    empty = planner._plan(load.now, planner.forecast.estimate(load.now, 20), counts)
    queued = MetricsSnapshot(load.now, 1, loads=(LoadReport(queued_prefill_tokens=200 * INPUT, num_waiting=200),))
    planner.observe_backlog(PREFILL, queued)
    behind = planner._plan(load.now, planner.forecast.estimate(load.now, 20), counts)
    assert empty.queued_requests == 0 and behind.queued_requests == 200
    assert behind.targets[PREFILL] > empty.targets[PREFILL]
    assert "200 requests queued" in behind.describe()
    planner.observe_backlog(PREFILL, MetricsSnapshot(load.now, 1))  # drained: the next plan is as before
    again = planner._plan(load.now, planner.forecast.estimate(load.now, 20), counts)
    assert again.targets == empty.targets and again.queued_requests == 0


def test_a_forecast_of_falling_load_does_not_shrink_the_pools_before_it_falls():
    """A forecast below the current rate (the far side of a peak): the plan is sized for the
    current rate, as on a flat load at that rate."""
    planner, load = flat_planner(20.0)
    forecast = planner.forecast.estimate(load.now, 20)
    falling = replace(forecast, predicted_rate=2.0)
    counts = {PREFILL: 1, DECODE: 1}
    assert planner._plan(load.now, falling, counts).targets == planner._plan(load.now, forecast, counts).targets
    quiet, quiet_load = flat_planner(2.0)
    small = quiet._plan(quiet_load.now, quiet.forecast.estimate(quiet_load.now, 20), counts).targets
    assert sum(small.values()) < sum(planner._plan(load.now, falling, counts).targets.values())
