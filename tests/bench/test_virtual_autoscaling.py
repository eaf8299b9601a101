"""The controller's Autoscaler with the live `sla` policy driving the virtual-time cluster
(bench/control_plane/virtual_autoscaling.py), on a short sinusoidal trace (1 <-> 30 req/s,
period 120 s, ~2000-token prompts, ~100-token answers, replicas serving 10 s after they are
asked for; then a quiet minute at 1 req/s, since the policy shrinks the pools only once the
load has fallen, not on a forecast of its fall) under a GPU budget below what the peak needs: prefill is scaled up before the load
peaks, the pools never hold more GPUs than the budget, the pools come back down after the
peak through drains that lose no request, and a removed replica's KV blocks are all free.
On the same trace the shipped reactive policies break the TTFT SLO on the ramp.
Virtual time and a seeded trace: the same run every time, whatever the box's load."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.bench.control_plane.bursty_autoscaling import serve_config, sinusoidal_workload
from splitserve.bench.control_plane.virtual_autoscaling import run_autoscaled
from splitserve.bench.control_plane.virtual_time_cluster import VirtualTimeCluster, long_context_copy
from splitserve.cluster.planning.queue_model import Deployment, Slo, percentile
from splitserve.cluster.planning.workload import LengthDistribution, Workload
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL

PROFILE, KV_BYTES = "llama-8b-h200", 131072
PERIOD_S, STARTUP_S, BUDGET = 120.0, 10.0, 3
QUIET_S = 60.0
BOUNDS = Deployment(3, 2, 2048)  # prefill 1..3, decode 1..2 replicas: 5 GPUs, more than the budget
# The module's sla run (~8 s of CPU) once, on one worker: split over two, each would run it.
pytestmark = pytest.mark.one_worker


SLO = Slo(1.0, 0.035)


@pytest.fixture(scope="module")
def serve(tiny_model, tmp_path_factory):
    model = long_context_copy(tiny_model, tmp_path_factory.mktemp("simulated") / "long-context")
    lengths = LengthDistribution(2000, 500), LengthDistribution(100, 20)
    peak = sinusoidal_workload(1.0, 30.0, PERIOD_S, PERIOD_S, *lengths, seed=1)
    quiet = sinusoidal_workload(1.0, 1.0, PERIOD_S, QUIET_S, *lengths, seed=2)
    after = tuple(replace(r, arrival_s=r.arrival_s + PERIOD_S) for r in quiet.requests)
    workload = Workload(peak.requests + after, f"{peak.description}, then {quiet.description}")

    def run(policy: str):
        cfg = serve_config(policy, BOUNDS, SLO, PROFILE, STARTUP_S)
        planner = cfg.planner.model_copy(update={"window_s": 10.0, "num_requests": 200, "gpu_budget": BUDGET})
        cfg = cfg.model_copy(update={"planner": planner})
        cluster = VirtualTimeCluster(model, PROFILE, False, 64, 2048, workload.max_total_tokens, KV_BYTES)
        return workload, cluster, run_autoscaled(cfg, cluster, workload, {PREFILL: 1, DECODE: 1}, STARTUP_S)

    return run


@pytest.fixture(scope="module")
def sla_run(serve):
    return serve("sla")


def test_the_sla_policy_scales_up_before_the_load_peaks(sla_run):
    _, _, run = sla_run
    ups = [e for e in run.events if e.action == "up"]
    assert ups and all("req/s forecast" in e.reason for e in ups), [e.reason for e in run.events]
    assert ups[0].pool == PREFILL and ups[0].finished_at is not None
    assert ups[0].finished_at < PERIOD_S / 2  # the new replica serves before the peak
    assert ups[0].finished_at - ups[0].at == pytest.approx(STARTUP_S)
    at_peak = next(s for s in run.samples if s.at >= PERIOD_S / 2)
    assert at_peak.serving[PREFILL] >= 2


def test_the_gpu_budget_and_the_bounds_hold(sla_run):
    _, _, run = sla_run
    held = [sum(s.provisioned[p] - s.draining[p] for p in (PREFILL, DECODE)) for s in run.samples]
    assert max(held) == BUDGET  # the peak asks for more: the budget is what stops it
    for sample in run.samples:
        assert 1 <= sample.serving[PREFILL] and sample.provisioned[PREFILL] <= BOUNDS.prefill_replicas
        assert 1 <= sample.serving[DECODE] and sample.provisioned[DECODE] <= BOUNDS.decode_replicas


def test_scaling_down_drains_and_loses_no_request(sla_run):
    workload, cluster, run = sla_run
    downs = [e for e in run.events if e.action == "down"]
    assert downs and all(e.ok for e in downs)
    assert run.samples[-1].serving == {PREFILL: 1, DECODE: 1}
    assert len(run.requests) == len(workload.requests)
    for measured, planned in zip(run.requests, workload.requests):
        assert len(measured.token_times) == planned.output_tokens
    assert len(run.removed) == sum(e.from_replicas - e.to_replicas for e in downs)
    for replica in run.removed:
        assert not replica.engine.has_unfinished()
        assert replica.engine.kv.num_free_blocks == cluster.engine_config.num_kv_blocks


def test_on_the_ramp_the_reactive_policies_break_the_ttft_slo_where_sla_holds_it(sla_run, serve):
    """The same requests, the shipped reactive policies (up to 5 GPUs, no budget): they step up
    once queued tokens and TTFT are already over target, one replica per start-up time, and the
    requests arriving on the ramp wait; the sla policy's replicas were serving before."""
    _, _, reactive = serve("reactive")
    assert reactive.events and all(e.reason.startswith("over target") for e in reactive.events if e.action == "up")

    def ramp_ttft_p90(run) -> float:
        return percentile([r.ttft_s for r in run.requests if r.arrival_s < PERIOD_S / 2], 90)

    assert ramp_ttft_p90(sla_run[2]) <= SLO.ttft_s < ramp_ttft_p90(reactive)


def test_on_a_step_up_the_sla_policy_starts_more_while_a_start_is_in_flight(tiny_model, tmp_path):
    """2 -> 24 req/s at once, prefill 1..6 and decode 1..2 replicas under a 6-GPU budget,
    replicas serving 20 s after they are asked for: the first plan after the step starts
    replicas, the next (one interval on, the window now full of the new rate) starts several
    more while those are still starting, rather than waiting out a start-up time; serving +
    starting replicas never pass the budget or the bounds, and every request finishes. The
    reactive policies on the same requests keep one action per pool at a time."""
    model = long_context_copy(tiny_model, tmp_path / "long-context")
    lengths = LengthDistribution(2000, 500), LengthDistribution(100, 20)
    low = sinusoidal_workload(2.0, 2.0, 100.0, 40.0, *lengths, seed=1)
    high = sinusoidal_workload(24.0, 24.0, 100.0, 60.0, *lengths, seed=2)
    after = tuple(replace(r, arrival_s=r.arrival_s + 40.0) for r in high.requests)
    workload = Workload(low.requests + after, f"{low.description}, then {high.description}")
    bounds, budget, startup_s = Deployment(6, 2, 2048), 6, 20.0

    def run(policy: str):
        cfg = serve_config(policy, bounds, SLO, PROFILE, startup_s)
        planner = cfg.planner.model_copy(update={"window_s": 10.0, "num_requests": 200, "gpu_budget": budget})
        cfg = cfg.model_copy(update={"planner": planner})
        cluster = VirtualTimeCluster(model, PROFILE, False, 64, 2048, workload.max_total_tokens, KV_BYTES)
        return run_autoscaled(cfg, cluster, workload, {PREFILL: 1, DECODE: 1}, startup_s)

    def overlapping(events):  # (earlier, later) starts of one pool, the later asked before the earlier served
        ups = [e for e in events if e.action == "up"]
        return [(a, b) for a in ups for b in ups if a.pool == b.pool and a.at < b.at < a.finished_at]

    sla = run("sla")
    pairs = overlapping(sla.events)
    assert pairs, [(e.at, e.pool, e.from_replicas, e.to_replicas, e.finished_at) for e in sla.events]
    first, more = pairs[0]
    interval_s = serve_config("sla", bounds, SLO, PROFILE, startup_s).prefill.autoscaling.interval_s
    assert first.at >= 40.0 and more.at - first.at <= interval_s
    assert more.from_replicas == first.to_replicas and more.to_replicas - more.from_replicas >= 2
    assert "replica(s) starting" in more.reason and all(e.ok for e in sla.events)
    for sample in sla.samples:
        held = {pool: sample.provisioned[pool] - sample.draining[pool] for pool in (PREFILL, DECODE)}
        assert held[PREFILL] + held[DECODE] <= budget
        assert held[PREFILL] <= bounds.prefill_replicas and held[DECODE] <= bounds.decode_replicas
    assert max(s.provisioned[PREFILL] - s.draining[PREFILL] for s in sla.samples) > first.to_replicas
    assert [len(r.token_times) for r in sla.requests] == [r.output_tokens for r in workload.requests]

    reactive = run("reactive")
    assert [e for e in reactive.events if e.action == "up"] and not overlapping(reactive.events)
