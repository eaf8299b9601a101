"""Autoscaling per phase on local Ray: graceful decode drain with streams in flight, a
rising-then-falling load that scales both pools up and back down, and the controller's wiring.
The policy's decisions alone: test_autoscaling_policy.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.control_plane.autoscale_load import ClosedLoopLoad
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.scaling.autoscaler import Autoscaler
from splitserve.cluster.scaling.load_forecast import DemandTotals
from splitserve.cluster.scaling.sla_policy import SlaScalingPolicy
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import start_cluster, wait_for_baseline

# ---- on local Ray: graceful drain, and a load that rises then falls ----------------------


# Autoscaling within [1, 2] with short delays: the tiny model's load turns within seconds.
QUICK_SCALING = {
    "enabled": True,
    "min_replicas": 1,
    "max_replicas": 2,
    "upscale_delay_s": 0.5,
    "downscale_delay_s": 2.0,
    "interval_s": 0.2,
    "metrics_stale_s": 2.0,
}
# A decode pool's: targets low enough that a dozen concurrent requests on the tiny model are over them.
QUICK_DECODE_SCALING = {**QUICK_SCALING, "target_running_per_replica": 2, "itl_target_ms": 1}


def scaled_config(model: str) -> ServeConfig:
    """1 prefill + 1 decode, each autoscaled by QUICK_SCALING; targets low enough that a dozen
    concurrent requests on the tiny model are over them."""
    pool = {"replicas": 1, "num_kv_blocks": 64, "resources": {"num_cpus": 1}, "torch_threads": 1}
    return ServeConfig.model_validate(
        {
            "model": model,
            "kv_transfer_lease_s": 5.0,
            "router": {"local_prefill_threshold": 0},
            "prefill": {
                **pool,
                "max_num_batched_tokens": 64,
                "autoscaling": {**QUICK_SCALING, "target_queued_tokens_per_replica": 16, "ttft_target_ms": 5},
            },
            "decode": {**pool, "autoscaling": QUICK_DECODE_SCALING},
        }
    )


# Output tokens at which the drain test holds the decode replica it drains: well short of its
# streams' 96, so each stream there is certainly mid-stream at the drain.
HOLD_AT = 8


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


async def wait_until(predicate, timeout_s: float | None, what: str) -> None:
    """timeout_s None: no deadline of its own (the test's timeout cancels it, noting what)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not predicate():
            if deadline is not None and time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            await asyncio.sleep(0.05)
    except BaseException as cancelled:
        if deadline is None:
            cancelled.add_note(f"while waiting for {what}")
        raise


async def rise_and_fall(autoscaler, load, concurrency: int, at, served=None, timeout_s: float = 60) -> None:
    """Start the autoscaler and the load; hold `concurrency` streams until at(2) (and served(),
    the new replicas' traffic), then none until at(1) with nothing in flight; stop both."""
    autoscaler.start()
    load.start()
    try:
        load.concurrency = concurrency  # rise
        await wait_until(lambda: at(2), timeout_s, "the scaled pools at 2 replicas")
        if served is not None:
            await wait_until(served, timeout_s, "the new replicas' traffic")
        load.concurrency = 0  # fall
        await wait_until(lambda: at(1) and load.num_inflight == 0, timeout_s, "the scaled pools back at 1")
    finally:
        await load.stop(60)
        await autoscaler.stop()


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

    recs: dict[int, dict] = {}

    async def stream(i: int, started: set) -> dict:
        rec = recs[i] = {"tokens": 0, "finish": None}

        def on_route(d) -> None:  # called per attempt; a retry would route again
            rec.setdefault("first_prefill", d.prefill_replica)
            rec["prefill"], rec["decode"] = d.prefill_replica, d.decode_replica

        async for chunk in cluster.generate(prompt(i), params, on_route=on_route):
            rec["tokens"] += len(chunk.token_ids)
            rec["finish"] = chunk.finish_reason if chunk.finished else rec["finish"]
            started.add(i)
        return rec

    async def hold_new_decode(hold_at: int) -> None:  # 0 releases
        await new_decode.handle.inject_fault.remote(hold_at_output_tokens=hold_at)

    async def scenario():
        started: set[int] = set()
        # The streams on the decode replica to drain stop at HOLD_AT tokens until released
        # below: mid-stream at the drain however long the others take to start (on a loaded
        # machine they finished there while the last stream waited for its first token).
        await hold_new_decode(HOLD_AT)
        try:
            tasks = [asyncio.ensure_future(stream(i, started)) for i in range(6)]
            await asyncio.sleep(0)  # every stream is routed, none has reached prefill
            prefill_drain = asyncio.ensure_future(cluster.drain_replica(PREFILL, new_prefill.replica_id, 60))
            await wait_until(lambda: len(started) == 6, None, "every stream's first token")
            on_decode = cluster.dispatcher.num_inflight(DECODE, new_decode.replica_id)
            there = [i for i, r in recs.items() if r.get("decode") == new_decode.replica_id and r["finish"] is None]
            decode_drain = asyncio.ensure_future(cluster.drain_replica(DECODE, new_decode.replica_id, 60))
            await asyncio.sleep(0)  # the drain task marks the replica draining
            draining = cluster.router.load(DECODE, new_decode.replica_id).draining and not decode_drain.done()
            late_task = asyncio.ensure_future(stream(100, set()))  # arrives during the drain: must go elsewhere
            await wait_until(lambda: "decode" in recs.get(100, {}), None, "the late stream's route")
        finally:
            await hold_new_decode(0)  # the held streams finish where they are
        late = await asyncio.wait_for(late_task, 60)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        drained = await asyncio.wait_for(asyncio.gather(prefill_drain, decode_drain), 60)
        return on_decode, there, results, late, draining, drained

    on_decode, there, results, late, was_draining, drained = loop.run(scenario(), timeout=240)
    assert any(r["first_prefill"] == new_prefill.replica_id for r in results), "nothing routed to the prefill"
    assert on_decode >= 1, "no stream was in flight on the drained decode replica"
    assert there, "no stream was mid-stream on the drained decode replica"
    assert all(results[i]["decode"] == new_decode.replica_id for i in there)  # finished where they were
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

    def added(pool: str) -> set[str]:
        """The pool's replicas started by the autoscaler that served a request."""
        return {rid for rid in load.replicas_used if rid.startswith(pool)} - initial[pool]

    served = lambda: all(added(pool) for pool in (PREFILL, DECODE))  # noqa: E731
    loop.run(rise_and_fall(autoscaler, load, 12, at, served, timeout_s=45), timeout=150)
    assert load.num_failed == 0, load.failures
    assert load.num_ok > 0 and set(load.finish_reasons) == {"length"}
    for pool in (PREFILL, DECODE):
        events = [(e.action, e.from_replicas, e.to_replicas) for e in autoscaler.events if e.pool == pool]
        assert events == [("up", 1, 2), ("down", 2, 1)], (pool, autoscaler.events)
        assert added(pool), f"the new {pool} replica never served a request"
        assert set(serving(cluster, pool)) <= initial[pool] | added(pool)
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
    between = time.monotonic()  # "a"'s TTFT sample is at most between - 0.5, "b"'s at least between - 0.1
    asyncio.run(report("b", ttft=[(0.1, 0.10)], itl=[(0.3, 0.01)]))
    assert controller.recent_latency_ms(PREFILL) == pytest.approx(250)
    assert controller.recent_latency_ms(DECODE) == pytest.approx(20)
    assert controller.recent_latency_ms(PREFILL, since=between - 0.3) == pytest.approx(100)  # only "b"'s sample
    plain = Controller(ServeConfig(model=tiny_model), tiny_model, "unit")
    assert plain.autoscaler is None
    assert Controller(scaled_config(tiny_model), tiny_model, "unit", autoscale=False).autoscaler is None
    # The frontends' in-process form runs its controller with the autoscaler, as the service does.
    from splitserve.cluster.frontend.backend import ServingBackend

    backend = ServingBackend(scaled_config(tiny_model), tiny_model)
    assert isinstance(backend.cluster.controller.autoscaler, Autoscaler)


def sla_config(model: str, engine: str) -> ServeConfig:
    """scaled_config with both pools on the sla policy: targets no deployment can meet on this
    box, so the plan is the most the bounds allow (2 each) while requests finish, and the
    minimum once none has finished for a window."""
    cfg = scaled_config(model).model_dump()
    for pool in ("prefill", "decode"):
        cfg[pool]["autoscaling"]["policy"] = "sla"
    cfg["planner"] = {"startup_s": 1.0, "window_s": 2.0, "num_requests": 50}
    return ServeConfig.model_validate({**cfg, "engine": engine})


@pytest.mark.ray
def test_the_sla_policy_scales_both_pools_up_under_load_and_down_losing_no_request(loop, scaled_cluster, tiny_model):
    """The sla policy on the real cluster: its demand is the load's own counters (the
    controller's, from the ingresses' reports, is the next test's); both pools go 1 -> 2 while
    requests run and back to 1 after they stop, drained with none failed."""
    cluster = scaled_cluster
    cfg = sla_config(tiny_model, cluster.cfg.engine)
    load = ClosedLoopLoad(
        cluster,
        lambda i: prompt(i, 64),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        max_concurrency=8,
        latency_window_s=1.0,
    )
    demand = lambda: DemandTotals(load._num_sent * 64, load.num_ok, load.num_ok * 64, load.num_ok * 24)  # noqa: E731
    metrics = PoolMetrics("tiny")
    autoscaler = Autoscaler(
        cluster,
        cfg,
        metrics,
        latency_source=load.latency_ms,
        drain_timeout_s=30,
        demand_source=demand,
        model_dir=tiny_model,
    )
    assert all(isinstance(p, SlaScalingPolicy) for p in autoscaler.policies.values())

    def at(num: int) -> bool:
        idle = not (autoscaler.scaling_in_progress(PREFILL) or autoscaler.scaling_in_progress(DECODE))
        return idle and all(len(cluster.router.replica_ids(pool)) == num for pool in (PREFILL, DECODE))

    loop.run(rise_and_fall(autoscaler, load, 8, at), timeout=200)
    assert load.num_failed == 0, load.failures
    for pool in (PREFILL, DECODE):
        events = [(e.action, e.from_replicas, e.to_replicas) for e in autoscaler.events if e.pool == pool]
        assert events == [("up", 1, 2), ("down", 2, 1)], (pool, autoscaler.events)
        # Each action's reason is the planner's: its forecast and prediction (or why it has none),
        # with a measured breach where that is what stepped the pool up.
        reasons = [e.reason for e in autoscaler.events if e.pool == pool]
        assert all("req/s forecast" in r or "no finished requests in the window" in r for r in reasons), reasons
    rendered = metrics.render().decode()
    assert 'splitserve_planner_target_replicas{model_name="tiny",pool="decode"} 1.0' in rendered
    wait_for_baseline(loop, cluster)


def test_the_controller_feeds_the_sla_policy_its_ingresses_counters(tiny_model):
    """Controller wiring without Ray: the sla policies share one planner whose demand is the
    ingresses' request counters, shipped in their reports and summed over the ingresses."""
    from splitserve.cluster.control.controller import Controller
    from splitserve.cluster.frontend.metrics import Metrics
    from splitserve.proto.messages.ingress_report import IngressReport, families_of

    controller = Controller(sla_config(tiny_model, "real"), tiny_model, "unit")
    policies = list(controller.autoscaler.policies.values())
    assert len(policies) == 2 and policies[0].planner is policies[1].planner
    for ingress_id, prompt_tokens in (("a", 100), ("b", 300)):
        ingress = Metrics(controller.model_name)
        ingress.prompt_tokens.inc(prompt_tokens)
        ingress.observe_finished("length", prompt_tokens, 24)
        report = IngressReport(metrics=families_of(ingress.registry)).to_bytes()
        asyncio.run(controller.membership(-1, ingress_id, report))
    assert policies[0].planner.demand() == DemandTotals(400, 2, 400, 48)
