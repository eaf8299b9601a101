"""The controller on local Ray, with real pool actors and the in-process ingress (a
DisaggCluster: Dispatcher + MembershipFollower): dead replicas and replicas whose engine loop
stopped are replaced until the pool is back at its target; failing starts back off; a drain
waits for every ingress to route by the draining view; a new controller re-adopts the live
pools (same actors, no reload); shutdown leaves no actor of the app. (Killing the controller
deployment under Serve: tests/cluster/test_serve_controller.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.control.controller import Controller
from splitserve.cluster.control.worker_pool import named_actors
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.proto.messages.ingress_report import IngressReport
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import cluster_config, start_cluster, wait_for_baseline, wait_for_refill, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CONTROLLER = {
    "probe_interval_s": 0.2,
    "restart_backoff_s": 0.5,
    "restart_backoff_max_s": 1.0,
    "healthy_after_s": 3.0,
    "ingress_timeout_s": 3.0,
}


def prompt(i: int) -> list[int]:
    return [(11 * i + 5 * k) % 400 + 20 for k in range(24)]


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model, loop):
    cfg = cluster_config(tiny_model, num_prefill=1, num_decode=2, controller=CONTROLLER)
    cluster = start_cluster(loop, cfg)
    yield cluster
    loop.run(cluster.shutdown(), timeout=90)


def serving(cluster, pool: str) -> set[str]:
    return set(cluster.router.replica_ids(pool, include_draining=False))


def run_requests(loop, cluster, num: int) -> list[tuple[dict, str]]:
    """num requests at once; (result, decode replica) each. Raises if one fails."""

    async def one(i: int):
        routes = []
        tokens = []
        async for chunk in cluster.generate(prompt(i), GREEDY, on_route=routes.append):
            tokens.extend(chunk.token_ids)
        return {"token_ids": tokens}, routes[-1].decode_replica

    async def all_of():
        return await asyncio.gather(*(one(i) for i in range(num)))

    return loop.run(all_of(), timeout=180)


def scraped(loop, cluster) -> dict:
    text = loop.run(cluster.render_metrics(b""), timeout=30).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_killed_idle_decode_is_replaced_and_the_next_20_requests_succeed(loop, cluster):
    controller = cluster.controller
    before = serving(cluster, DECODE)
    assert len(before) == 2
    victim = sorted(before)[0]
    num_events = len(controller.events)
    ray.kill(cluster.decode_pool.get(victim).handle, no_restart=True)
    killed_at = time.monotonic()
    new = wait_until(
        lambda: (
            victim not in serving(cluster, DECODE)
            and len(serving(cluster, DECODE)) == 2
            and serving(cluster, DECODE) - before
        ),
        None,
        "no replacement decode replica became routable",
    )
    print(f"decode replica killed: replacement {sorted(new)} routable after {time.monotonic() - killed_at:.1f} s")
    events = [(e.what, e.replica_id) for e in controller.events[num_events:]]
    assert ("lost", victim) in events and ("started", next(iter(new))) in events, events
    results = run_requests(loop, cluster, 20)
    assert all(len(result["token_ids"]) == GREEDY.max_tokens for result, _ in results)
    assert next(iter(new)) in {decode for _, decode in results}, "the replacement never served"
    metrics = scraped(loop, cluster)
    model_name = cluster.cfg.model_id
    assert metrics[("splitserve_replicas", (("model_name", model_name), ("pool", DECODE)))] == 2

    def kv_series() -> set[str]:
        return {
            dict(labels)["replica"] for name, labels in scraped(loop, cluster) if name == "splitserve_kv_block_usage"
        }

    # The replacement's series appears at the controller's first probe of it (every probe_interval_s).
    def with_replacement() -> set[str] | None:
        found = kv_series()
        return found if next(iter(new)) in found else None

    series = wait_until(with_replacement, None, "no series of the replacement")
    assert victim not in series
    assert cluster.expected_replicas[DECODE] == 2 and cluster.live_replicas(DECODE) == 2
    wait_for_baseline(loop, cluster)


def test_replica_whose_engine_loop_stopped_is_killed_and_replaced(loop, cluster):
    """The actor is alive but its engine loop is not: every call fails with
    EngineLoopStopped. The controller kills it and starts another."""
    before = serving(cluster, PREFILL)
    [victim] = before
    handle = cluster.prefill_pool.get(victim).handle
    ray.get(handle.shutdown.remote(), timeout=30)  # stops the engine loop, keeps the actor
    new = wait_until(
        lambda: victim not in serving(cluster, PREFILL) and serving(cluster, PREFILL),
        None,
        "no replacement prefill replica became routable",
    )
    wait_until(lambda: victim not in named_actors(cluster.controller.namespace), None, "the stopped replica still runs")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(handle.ready.remote(), timeout=30)
    results = run_requests(loop, cluster, 4)
    assert all(len(result["token_ids"]) == GREEDY.max_tokens for result, _ in results)
    assert new == serving(cluster, PREFILL)
    wait_for_baseline(loop, cluster)


def test_failing_starts_are_retried_with_growing_delays(loop, cluster, tmp_path):
    """A long-lived replica that dies is replaced at once; when the replacement cannot start
    (here: the pool's model is missing) the pool retries after 0.5 s, doubling up to 1 s, one
    attempt at a time -- no restart storm; once starts work again it recovers."""
    controller = cluster.controller
    pool = cluster.decode_pool
    wait_until(lambda: controller.backoff[DECODE].num_failures == 0, None, "earlier failures not forgiven")
    victim = min(pool.live_replicas(), key=lambda r: r.ready_at)
    wait_until(lambda: time.monotonic() - victim.ready_at > 3.0, None, "the victim is not long-lived")
    good_model = pool.engine_config["model"]
    num_events = len(controller.events)
    pool.engine_config["model"] = str(tmp_path / "no-such-model")
    try:
        ray.kill(victim.handle, no_restart=True)

        def failures():
            found = [e for e in controller.events[num_events:] if e.what == "start-failed"]
            return found if len(found) >= 3 else None

        wait_until(failures, None, "the pool did not retry three times")
        assert controller.refilling(DECODE) and not controller.refilling(PREFILL)  # an autoscaler holds
    finally:
        pool.engine_config["model"] = good_model
    events = [e for e in controller.events[num_events:] if e.pool == DECODE]
    lost = next(e for e in events if e.what == "lost")
    assert lost.replica_id == victim.replica_id and lost.backoff_s == 0.0  # long-lived: replaced at once
    attempts = [e for e in events if e.what in ("starting", "start-failed")]
    # starting, failed, starting, failed, ...: one at a time, each after the previous wait
    waits, previous = [], lost
    for start, failed in zip(attempts[0::2], attempts[1::2]):
        assert (start.what, failed.what, start.replica_id) == ("starting", "start-failed", failed.replica_id)
        assert start.at - previous.at >= previous.backoff_s - 0.05, (start, previous)
        waits.append(failed.backoff_s)
        previous = failed
    assert waits[:3] == [0.5, 1.0, 1.0], waits  # doubling, capped at restart_backoff_max_s
    print(f"failing starts: waits {waits}, attempts at {[round(e.at - lost.at, 1) for e in attempts[0::2]]} s")
    wait_until(lambda: len(serving(cluster, DECODE)) == 2, None, "the pool did not recover")
    results = run_requests(loop, cluster, 4)
    assert all(len(result["token_ids"]) == GREEDY.max_tokens for result, _ in results)


def test_drain_waits_for_every_ingress_to_route_by_the_draining_view(loop, cluster):
    """A second ingress (reporting by hand) holds a drain until it has applied the view that
    marked the replica draining AND has nothing in flight there."""
    controller = cluster.controller
    [replica] = loop.run(cluster.add_replicas(DECODE, 1), timeout=120)
    rid = replica.replica_id

    def report(version: int, inflight: dict) -> None:
        loop.run(controller.membership(version, "other-ingress", IngressReport(inflight=inflight).to_bytes()))

    report(controller.version, {rid: 1})  # routes by the current view, one request on rid
    drain = asyncio.run_coroutine_threadsafe(cluster.drain_replica(DECODE, rid, 60), loop.loop)
    wait_until(lambda: controller.pools[DECODE].get(rid).draining, None, "not marked draining")
    draining_version = controller.version
    stop = threading.Event()

    def keep_reporting(version_fn, inflight):  # an ingress calls every fraction of a second
        while not stop.wait(0.2):
            report(version_fn(), inflight)

    reporter = threading.Thread(target=keep_reporting, args=(lambda: draining_version - 1, {rid: 1}), daemon=True)
    reporter.start()
    time.sleep(1.5)
    assert not drain.done(), "drained while an ingress still routed by the old view"
    stop.set()
    reporter.join()
    stop.clear()
    reporter = threading.Thread(target=keep_reporting, args=(lambda: draining_version, {rid: 1}), daemon=True)
    reporter.start()
    time.sleep(1.5)
    assert not drain.done(), "drained while an ingress still had a request on the replica"
    stop.set()
    reporter.join()
    stop.clear()
    reporter = threading.Thread(target=keep_reporting, args=(lambda: controller.version, {}), daemon=True)
    reporter.start()
    try:
        assert drain.result(30) is True
    finally:
        stop.set()
        reporter.join()
    assert rid not in cluster.router.replica_ids(DECODE) and controller.pools[DECODE].get(rid) is None
    # ray.kill returns before Ray drops the actor's name: its name goes soon after.
    wait_until(lambda: rid not in named_actors(controller.namespace), None, "the drained actor still named")


def test_a_sigtermed_replica_gets_exactly_one_replacement(loop, cluster):
    """SIGTERM on an idle decode replica's process: the controller drains it and starts its
    replacement at once. The round that sees the SIGTERM then starts what each pool misses, and
    must count the replacement it just started: one start, and the pool ends at its target."""
    controller = cluster.controller
    target = controller.targets[DECODE]
    wait_for_refill(cluster, DECODE, target)

    async def end_backoff() -> None:  # earlier tests' failures would hold the start back
        controller.backoff[DECODE].next_start_at = float("-inf")

    loop.run(end_backoff(), timeout=10)
    victim = sorted(serving(cluster, DECODE))[0]
    pid = ray.get(controller.pools[DECODE].get(victim).handle.process_id.remote(), timeout=30)
    os.kill(pid, signal.SIGTERM)
    events = lambda: [(e.what, e.replica_id) for e in controller.events if e.pool == DECODE]  # noqa: E731
    wait_until(lambda: ("drained", victim) in events(), None, lambda: f"not drained: {events()[-6:]}")
    wait_for_refill(cluster, DECODE, target)
    after = events()[events().index(("sigterm", victim)) :]
    assert [what for what, _ in after].count("starting") == 1, after
    assert len(controller.pools[DECODE].replicas) == target, after


def test_a_new_controller_adopts_the_live_pools_without_reloading(loop, cluster):
    """The old controller stops (as if killed: its pools stay); the ingress keeps serving by
    its last view; a new controller of the same app finds every replica by name -- same
    actors, same cached prefixes -- and the ingress follows it without re-indexing."""
    old = cluster.controller
    actors = {r.replica_id: r.actor_id for p in old.pools.values() for r in p.live_replicas()}
    snapshots = {rid: ray.get(old.pools[rid.split("-")[0]].get(rid).handle.snapshot.remote()) for rid in actors}
    routed = dict(cluster.dispatcher.replica_infos())

    loop.run(old.pause())  # a dead controller does nothing more, and kills nothing
    results = run_requests(loop, cluster, 4)  # serving continues without a controller
    assert all(len(result["token_ids"]) == GREEDY.max_tokens for result, _ in results)

    new = Controller(cluster.cfg, cluster.model_dir, old.namespace.removeprefix("splitserve-"), autoscale=False)
    loop.run(new.start(), timeout=120)
    cluster.controller = new  # the Serve handle reaches whichever replica is up
    cluster.follower.fetch = new.membership
    assert {r.replica_id: r.actor_id for p in new.pools.values() for r in p.live_replicas()} == actors
    assert {e.replica_id for e in new.events if e.what == "adopted"} == set(actors)
    assert new.version > old.version  # the ingress takes the new view as newer
    for rid in actors:  # same processes: the prefix cache is what it was (no reload)
        _, hashes = ray.get(new.pools[rid.split("-")[0]].get(rid).handle.snapshot.remote())
        assert set(hashes) >= set(snapshots[rid][1])
    wait_until(lambda: cluster.follower.applied_version == new.version, None, "the ingress did not follow")
    assert all(cluster.dispatcher.replica_infos()[key] is replica for key, replica in routed.items())
    results = run_requests(loop, cluster, 4)
    assert all(len(result["token_ids"]) == GREEDY.max_tokens for result, _ in results)


def test_shutdown_kills_every_pool_actor(loop, cluster):
    namespace = cluster.controller.namespace
    assert named_actors(namespace)
    loop.run(cluster.shutdown(), timeout=90)
    assert named_actors(namespace) == []
