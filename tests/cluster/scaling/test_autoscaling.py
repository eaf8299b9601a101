"""Autoscaling per phase: policy decisions (pure), graceful decode drain with streams in
flight, and a rising-then-falling load that scales both pools up and back down (local Ray)."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.autoscale_load import ClosedLoopLoad
from splitserve.cluster.config import DecodeAutoscalingConfig, PrefillAutoscalingConfig, ServeConfig
from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.router import DECODE, PREFILL
from splitserve.cluster.scaling.autoscaler import Autoscaler
from splitserve.cluster.scaling.latency_window import LatencyWindow
from splitserve.cluster.scaling.policy import (
    DecodeScalingPolicy,
    MetricsSnapshot,
    PrefillScalingPolicy,
    initial_replicas,
)
from splitserve.engine.io.sampling_params import SamplingParams
from tests.helpers.cluster import start_cluster, wait_for_baseline

# ---- policy unit tests (no Ray) ------------------------------------------------------------

PREFILL_CFG = PrefillAutoscalingConfig(
    enabled=True,
    min_replicas=1,
    max_replicas=3,
    step=1,
    upscale_delay_s=2,
    downscale_delay_s=5,
    metrics_stale_s=3,
    target_queued_tokens_per_replica=100,
    ttft_target_ms=500,
)
DECODE_CFG = DecodeAutoscalingConfig(
    enabled=True,
    min_replicas=1,
    max_replicas=4,
    step=2,
    upscale_delay_s=2,
    downscale_delay_s=5,
    metrics_stale_s=3,
    target_kv_usage=0.8,
    target_running_per_replica=8,
    itl_target_ms=50,
)


def prefill_snap(t, n, queued_each=0, ttft=None) -> MetricsSnapshot:
    return MetricsSnapshot(t, n, [LoadReport(queued_prefill_tokens=queued_each)] * n, ttft_p90_ms=ttft)


def decode_snap(t, n, running_each=0, kv=0.0, itl=None) -> MetricsSnapshot:
    return MetricsSnapshot(t, n, [LoadReport(num_running=running_each, kv_usage=kv)] * n, itl_p90_ms=itl)


def run_policy(policy, snaps_at):
    """[(now, snapshot)] -> [action] in order."""
    return [policy.decide(snap, now).action for now, snap in snaps_at]


def test_prefill_scales_up_on_queued_tokens_after_delay_then_cools_down():
    p = PrefillScalingPolicy(PREFILL_CFG)
    actions = run_policy(p, [(t, prefill_snap(t, 1, queued_each=150)) for t in (0, 1, 1.9)])
    assert actions == ["hold", "hold", "hold"]  # over, but not for upscale_delay_s yet
    d = p.decide(prefill_snap(2.0, 1, queued_each=150), 2.0)
    assert (d.action, d.target_replicas) == ("up", 2) and "queued_tokens_per_replica" in d.reason
    # cooldown: still over target, but holds for upscale_delay_s and gathers no evidence
    d = p.decide(prefill_snap(3.0, 2, queued_each=150), 3.0)
    assert d.action == "hold" and "cooldown" in d.reason
    assert run_policy(p, [(t, prefill_snap(t, 2, queued_each=150)) for t in (4.0, 5.0)]) == ["hold", "hold"]
    assert p.decide(prefill_snap(6.0, 2, queued_each=150), 6.0).target_replicas == 3
    # at max: over target is a hold
    p.mark_scaled(6.0)
    d = p.decide(prefill_snap(20.0, 3, queued_each=999), 20.0)
    assert d.action == "hold" and "max_replicas" in d.reason


def test_prefill_scales_up_on_ttft_and_an_interruption_restarts_the_delay():
    p = PrefillScalingPolicy(PREFILL_CFG)
    assert run_policy(
        p,
        [
            (0, prefill_snap(0, 1, ttft=900)),
            (1.5, prefill_snap(1.5, 1, ttft=100)),
            (2.5, prefill_snap(2.5, 1, ttft=900)),
            (4.0, prefill_snap(4.0, 1, ttft=900)),
        ],
    ) == ["hold", "hold", "hold", "hold"]
    assert p.decide(prefill_snap(4.5, 1, ttft=900), 4.5).action == "up"


def test_prefill_scales_down_only_when_well_under_for_the_delay():
    p = PrefillScalingPolicy(PREFILL_CFG)
    # 60 queued tokens: under the target of 100 but not under half of it -> never down
    assert set(run_policy(p, [(t, prefill_snap(t, 2, queued_each=60)) for t in range(0, 12)])) == {"hold"}
    p = PrefillScalingPolicy(PREFILL_CFG)
    assert run_policy(p, [(t, prefill_snap(t, 2, queued_each=10, ttft=200)) for t in (0, 4.9)]) == ["hold", "hold"]
    d = p.decide(prefill_snap(5.0, 2, queued_each=10, ttft=200), 5.0)
    assert (d.action, d.target_replicas) == ("down", 1)
    # at min_replicas: never below
    p.mark_scaled(5.0)
    assert set(run_policy(p, [(t, prefill_snap(t, 1)) for t in range(6, 30)])) == {"hold"}


def test_prefill_latency_over_target_blocks_scale_down():
    p = PrefillScalingPolicy(PREFILL_CFG.model_copy(update={"max_replicas": 2}))
    # at max, TTFT over target: no evidence for "down" however long it lasts
    assert set(run_policy(p, [(t, prefill_snap(t, 2, ttft=800)) for t in range(0, 20)])) == {"hold"}


def test_prefill_holds_on_stale_metrics_and_restarts_evidence():
    p = PrefillScalingPolicy(PREFILL_CFG)
    assert p.decide(prefill_snap(0, 1, queued_each=500), 0).action == "hold"
    d = p.decide(prefill_snap(0, 1, queued_each=500), 3.5)  # 3.5 s old > metrics_stale_s 3
    assert d.action == "hold" and "stale" in d.reason
    assert p.decide(prefill_snap(4, 1, queued_each=500), 4).action == "hold"  # evidence restarted
    assert p.decide(prefill_snap(6, 1, queued_each=500), 6).action == "up"


def test_min_max_clamps_act_at_once():
    p = PrefillScalingPolicy(PREFILL_CFG.model_copy(update={"min_replicas": 2}))
    d = p.decide(prefill_snap(0, 0), 0)
    assert (d.action, d.target_replicas) == ("up", 2)
    d = DecodeScalingPolicy(DECODE_CFG).decide(decode_snap(0, 6), 0)
    assert (d.action, d.target_replicas) == ("down", 4)
    assert initial_replicas(1, PREFILL_CFG.model_copy(update={"min_replicas": 2})) == 2
    assert initial_replicas(9, PREFILL_CFG) == 3
    assert initial_replicas(0, PrefillAutoscalingConfig()) == 0  # disabled: as configured


@pytest.mark.parametrize(
    "snap_kwargs, signal",
    [({"kv": 0.9}, "kv_usage"), ({"running_each": 9}, "running_per_replica"), ({"itl": 80.0}, "itl_p90_ms")],
)
def test_decode_scales_up_on_each_signal_by_step_within_max(snap_kwargs, signal):
    p = DecodeScalingPolicy(DECODE_CFG)
    assert p.decide(decode_snap(0, 3, **snap_kwargs), 0).action == "hold"
    d = p.decide(decode_snap(2, 3, **snap_kwargs), 2)
    assert (d.action, d.target_replicas) == ("up", 4)  # step 2, clamped to max 4
    assert signal in d.reason


def test_decode_scales_down_by_step_within_min_and_cools_down():
    p = DecodeScalingPolicy(DECODE_CFG.model_copy(update={"min_replicas": 2}))

    def quiet(t, n):  # every signal below half its target
        return decode_snap(t, n, running_each=3, kv=0.3, itl=20.0)

    assert p.decide(quiet(0, 4), 0).action == "hold"
    d = p.decide(quiet(5, 4), 5)
    assert (d.action, d.target_replicas) == ("down", 2)
    assert p.decide(quiet(6, 3), 6).reason.startswith("cooldown")
    # running 5 per replica is under target 8 but not under half: hold
    assert set(run_policy(p, [(t, decode_snap(t, 3, running_each=5)) for t in range(8, 20)])) == {"hold"}
    d = p.decide(quiet(40, 3), 40)
    assert d.action == "hold"
    d = p.decide(quiet(45, 3), 45)
    assert (d.action, d.target_replicas) == ("down", 2)  # never below min_replicas 2


def test_decode_idle_with_no_latency_samples_scales_down():
    p = DecodeScalingPolicy(DECODE_CFG)
    assert run_policy(p, [(0, decode_snap(0, 2)), (5, decode_snap(5, 2))]) == ["hold", "down"]


def test_policy_rejects_the_other_pools_config():
    with pytest.raises(TypeError):
        PrefillScalingPolicy(DECODE_CFG)
    with pytest.raises(ValueError):
        LoadReport(kv_usage=1.5)


def test_latency_window_percentile_respects_window_and_since():
    w = LatencyWindow(window_s=10)
    for i in range(1, 11):
        w.observe(i / 1000, now=float(i))  # 1..10 ms at t=1..10
    assert w.percentile_ms(90, now=10.0) == pytest.approx(9.0)
    assert w.percentile_ms(50, since=8.0, now=10.0) == pytest.approx(9.0)  # 8, 9, 10
    assert w.percentile_ms(90, now=25.0) is None  # all expired
    assert len(w) == 0


# ---- on local Ray: graceful drain, and a load that rises then falls ----------------------


def scaled_config(model: str) -> ServeConfig:
    """1 prefill + 1 decode, each autoscaled within [1, 2] with short delays; targets low
    enough that a dozen concurrent requests on the tiny model are over them."""
    timing = {
        "enabled": True,
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 0.5,
        "downscale_delay_s": 2.0,
        "interval_s": 0.2,
        "metrics_stale_s": 2.0,
    }
    pool = {"replicas": 1, "num_kv_blocks": 64, "resources": {"num_cpus": 1}, "torch_threads": 1}
    return ServeConfig.model_validate(
        {
            "model": model,
            "kv_transfer_lease_s": 5.0,
            "router": {"local_prefill_threshold": 0},
            "prefill": {
                **pool,
                "max_num_batched_tokens": 64,
                "autoscaling": {**timing, "target_queued_tokens_per_replica": 16, "ttft_target_ms": 5},
            },
            "decode": {**pool, "autoscaling": {**timing, "target_running_per_replica": 2, "itl_target_ms": 1}},
        }
    )


def prompt(i: int, length: int = 40) -> list[int]:
    return [(13 * i + 7 * k) % 400 + 20 for k in range(length)]


# Both engines: the simulated one (engine/simulated) keeps the scheduler, loads, drain and
# handoff that autoscaling acts on, so it must scale and drain alike.
@pytest.fixture(scope="module", params=["real", "simulated"])
def scaled_cluster(ray_cluster, tiny_model, loop, request):
    cfg = ServeConfig.model_validate({**scaled_config(tiny_model).model_dump(), "engine": request.param})
    cluster = start_cluster(loop, cfg)
    yield cluster
    loop.run(cluster.shutdown(), timeout=60)


def serving(cluster, pool: str) -> list:
    return cluster.router.replica_ids(pool, include_draining=False)


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.ray
def test_draining_completes_every_in_flight_request(loop, scaled_cluster):
    """A prefill replica drained right after requests were routed to it (their calls have not
    reached it yet) and a decode replica drained mid-stream: every stream completes, nothing
    is retried, both replicas are gone afterwards."""
    cluster = scaled_cluster
    retries_before = cluster.dispatcher.num_retries

    async def add_both():
        return await asyncio.gather(cluster.add_replicas(PREFILL, 1), cluster.add_replicas(DECODE, 1))

    [new_prefill], [new_decode] = loop.run(add_both(), timeout=120)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)

    async def stream(i: int, started: set) -> dict:
        rec = {"tokens": 0, "finish": None}

        def on_route(d) -> None:  # called per attempt; a retry would route again
            rec.setdefault("first_prefill", d.prefill_replica)
            rec["prefill"], rec["decode"] = d.prefill_replica, d.decode_replica

        async for chunk in cluster.generate(prompt(i), params, on_route=on_route):
            rec["tokens"] += len(chunk.token_ids)
            rec["finish"] = chunk.finish_reason if chunk.finished else rec["finish"]
            started.add(i)
        return rec

    async def scenario():
        started: set[int] = set()
        tasks = [asyncio.ensure_future(stream(i, started)) for i in range(6)]
        await asyncio.sleep(0)  # every stream is routed, none has reached prefill
        prefill_drain = asyncio.ensure_future(cluster.drain_replica(PREFILL, new_prefill.replica_id, 60))
        await wait_until(lambda: len(started) == 6, 30, "every stream's first token")
        on_decode = cluster.dispatcher.num_inflight(DECODE, new_decode.replica_id)
        decode_drain = asyncio.ensure_future(cluster.drain_replica(DECODE, new_decode.replica_id, 60))
        await asyncio.sleep(0)  # the drain task marks the replica draining
        draining = cluster.router.load(DECODE, new_decode.replica_id).draining and not decode_drain.done()
        late = await stream(100, set())  # arrives during the drain: must go elsewhere
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        drained = await asyncio.wait_for(asyncio.gather(prefill_drain, decode_drain), 60)
        return on_decode, results, late, draining, drained

    on_decode, results, late, was_draining, drained = loop.run(scenario(), timeout=120)
    assert any(r["first_prefill"] == new_prefill.replica_id for r in results), "nothing routed to the prefill"
    assert on_decode >= 1, "no stream was in flight on the drained decode replica"
    assert sum(r["decode"] == new_decode.replica_id for r in results) == on_decode
    assert all(r["finish"] == "length" and r["tokens"] == 96 for r in results), results
    assert cluster.dispatcher.num_retries == retries_before, "a drained replica failed a request"
    assert late["decode"] != new_decode.replica_id and late["finish"] == "length"
    assert was_draining and drained == [True, True]
    for pool, replica in ((PREFILL, new_prefill), (DECODE, new_decode)):
        assert replica.replica_id not in cluster.router.replica_ids(pool)
        assert cluster.pools[pool].get(replica.replica_id) is None
        assert len(serving(cluster, pool)) == 1
    wait_for_baseline(loop, cluster)


@pytest.mark.ray
def test_rising_then_falling_load_scales_each_pool_up_and_back_down(loop, scaled_cluster):
    cluster = scaled_cluster
    cfg = cluster.cfg
    initial = {pool: set(serving(cluster, pool)) for pool in (PREFILL, DECODE)}
    assert {pool: len(ids) for pool, ids in initial.items()} == {PREFILL: 1, DECODE: 1}
    load = ClosedLoopLoad(
        cluster,
        lambda i: prompt(i, 64),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        max_concurrency=12,
        latency_window_s=1.0,
    )
    metrics = PoolMetrics("tiny")
    autoscaler = Autoscaler(cluster, cfg, metrics, latency_source=load.latency_ms, drain_timeout_s=30)
    samples: list[tuple[int, int, int, int]] = []  # serving and total (incl. draining) per pool

    def sample() -> bool:
        samples.append(
            (
                len(serving(cluster, PREFILL)),
                len(cluster.router.replica_ids(PREFILL)),
                len(serving(cluster, DECODE)),
                len(cluster.router.replica_ids(DECODE)),
            )
        )
        return True

    def at(num: int) -> bool:
        sample()
        idle = not (autoscaler.scaling_in_progress(PREFILL) or autoscaler.scaling_in_progress(DECODE))
        return idle and samples[-1] == (num, num, num, num)

    async def scenario():
        autoscaler.start()
        load.start()
        try:
            load.concurrency = 12  # rise
            await wait_until(lambda: at(2), 45, "both pools at 2 replicas")
            await asyncio.sleep(1.0)  # the new replicas take traffic
            load.concurrency = 0  # fall
            await wait_until(lambda: at(1) and load.num_inflight == 0, 30, "both pools back at 1")
        finally:
            await load.stop(30)
            await autoscaler.stop()

    loop.run(scenario(), timeout=90)
    assert load.num_failed == 0, load.failures
    assert load.num_ok > 0 and set(load.finish_reasons) == {"length"}
    for pool in (PREFILL, DECODE):
        events = [(e.action, e.from_replicas, e.to_replicas) for e in autoscaler.events if e.pool == pool]
        assert events == [("up", 1, 2), ("down", 2, 1)], (pool, autoscaler.events)
        added = {rid for rid in load.replicas_used if rid.startswith(pool)} - initial[pool]
        assert added, f"the new {pool} replica never served a request"
        assert set(serving(cluster, pool)) <= initial[pool] | added
    assert all(1 <= n <= 2 for s in samples for n in s), "a pool left [min_replicas, max_replicas]"
    scraped = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    for pool in (PREFILL, DECODE):
        for action in ("up", "down"):
            key = (("decision", action), ("model_name", "tiny"), ("pool", pool))
            assert scraped[("splitserve_scaling_decisions_total", key)] == 1
        key = (("decision", "hold"), ("model_name", "tiny"), ("pool", pool))
        assert scraped[("splitserve_scaling_decisions_total", key)] > 1
        assert scraped[("splitserve_replicas", (("model_name", "tiny"), ("pool", pool)))] == 1
    wait_for_baseline(loop, cluster)


def test_controller_wires_the_autoscaler_to_the_ingresses_latencies(tiny_model):
    """The autoscaler runs in the controller; its TTFT / ITL come from the ingresses' reports
    (ages, not timestamps: no clock is shared), pooled over every ingress."""
    from splitserve.cluster.control.controller import Controller
    from splitserve.proto.messages.ingress_report import IngressReport

    controller = Controller(scaled_config(tiny_model), tiny_model, "unit")
    assert isinstance(controller.autoscaler, Autoscaler) and set(controller.autoscaler.policies) == {PREFILL, DECODE}
    assert controller.autoscaler.cluster is controller

    async def report(ingress_id: str, **samples):
        return await controller.membership(-1, ingress_id, IngressReport(**samples).to_bytes())

    asyncio.run(report("a", ttft=[(0.5, 0.25)], itl=[(0.1, 0.02), (0.2, 0.02)]))
    asyncio.run(report("b", ttft=[(0.1, 0.10)], itl=[(0.3, 0.01)]))
    assert controller.recent_latency_ms(PREFILL) == pytest.approx(250)
    assert controller.recent_latency_ms(DECODE) == pytest.approx(20)
    now = time.monotonic()
    assert controller.recent_latency_ms(PREFILL, since=now - 0.3) == pytest.approx(100)  # only "b"'s sample
    plain = Controller(ServeConfig(model=tiny_model), tiny_model, "unit")
    assert plain.autoscaler is None
    assert Controller(scaled_config(tiny_model), tiny_model, "unit", autoscale=False).autoscaler is None
    # The frontends' in-process form runs its controller with the autoscaler, as the service does.
    from splitserve.cluster.frontend.backend import ServingBackend

    backend = ServingBackend(scaled_config(tiny_model), tiny_model)
    assert isinstance(backend.cluster.controller.autoscaler, Autoscaler)
