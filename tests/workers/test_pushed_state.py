"""Pushed replica state (replica_state.updates: push) on a simulated 1P+2D cluster: replicas push
their KV events and load over each ingress's request channel, and the controller reads the
same pushes instead of probing. Lost frames -> one snapshot; a replica that stops pushing is
polled; one that dies mid-stream leaves this ingress's routing before the controller acts; an
ingress that joins late is indexed from a snapshot and then follows the pushes; a burst loses
no event; every block comes back."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from splitserve.cluster.ingress.dispatcher import Dispatcher
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import (
    cluster_config,
    start_cluster,
    wait_for_baseline,
    wait_for_refill,
    wait_until,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
SIMULATED = {"engine": "simulated", "engine_profile": "llama-8b-h200"}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model, loop):
    cfg = cluster_config(
        tiny_model,
        num_prefill=1,
        num_decode=2,
        policy="kv",
        num_blocks=256,
        # Default heartbeat (1 s): a replica is "silent" after 3 s, far from the 0.1 s between
        # frames while requests run, so a lost frame is seen as a jump, not a resubscription.
        replica_state={"heartbeat_s": 1.0},
        controller={"probe_interval_s": 0.2},
        **SIMULATED,
    )
    cluster = start_cluster(loop, cfg)
    yield cluster
    loop.run(cluster.shutdown(), timeout=60)


def prompt(seed: int, blocks: int = 3) -> list[int]:
    return [(37 * i + 11 * seed) % 480 + 20 for i in range(16 * blocks + 3)]


def run_requests(loop, cluster, prompts, params=GREEDY) -> list[dict]:
    async def go():
        return await asyncio.gather(*(cluster.complete(p, params) for p in prompts))

    return loop.run(go(), timeout=120)


def index_matches(cluster, router: Router | None = None) -> bool:
    """Every replica's index in this router holds exactly the replica's own snapshot."""
    router = router or cluster.router
    for pool in (PREFILL, DECODE):
        for member in cluster.dispatcher.members[pool].values():
            seq, hashes, *_ = ray.get(member.handle.snapshot.remote(), timeout=10)
            rid = member.info.replica_id
            if rid not in router.replica_ids(pool) or router.index(pool).replica_hashes(rid) != set(hashes):
                return False
            if router.index(pool).last_seq(rid) != seq:
                return False
    return True


def test_the_ingress_and_the_controller_follow_pushes_not_polls(loop, cluster):
    pushed = cluster.dispatcher.pushed
    frames, feed_frames = pushed.num_frames, cluster.controller.state_feed.num_frames
    run_requests(loop, cluster, [prompt(1), prompt(2)])
    wait_until(lambda: index_matches(cluster), None, "the pushed events did not reach the index")
    assert pushed.num_frames > frames
    wait_until(lambda: cluster.controller.state_feed.num_frames > feed_frames, None, "the controller got no push")
    for members in cluster.dispatcher.members.values():
        assert all(m.channel is not None and m.channel.subscribed for m in members.values())
    wait_for_baseline(loop, cluster)


def test_lost_frames_are_noticed_and_resynced_from_one_snapshot(loop, cluster):
    pushed = cluster.dispatcher.pushed
    victim = cluster.dispatcher.members[PREFILL]["prefill-0"]
    resyncs = pushed.num_resyncs
    ray.get(victim.handle.inject_fault.remote(skip_state_frames=1), timeout=10)
    run_requests(loop, cluster, [prompt(10 + i) for i in range(3)])  # new blocks: new frames
    wait_until(lambda: pushed.num_resyncs > resyncs, None, "the frame-number jump caused no resync")
    wait_until(lambda: index_matches(cluster), None, "the index differs from the replicas after the resync")
    # The resync covered what the skipped frame carried: the prefixes are found again.
    decision = cluster.router.route(prompt(10))
    assert decision.prefill_cached_tokens >= 3 * 16
    wait_for_baseline(loop, cluster)


def test_a_replica_that_stops_pushing_is_polled_and_stays_routed(loop, cluster):
    pushed = cluster.dispatcher.pushed
    victim = cluster.dispatcher.members[DECODE]["decode-0"]
    polls = pushed.num_fallback_polls
    ray.get(victim.handle.inject_fault.remote(skip_state_frames=10**9), timeout=10)
    try:
        wait_until(lambda: pushed.num_fallback_polls > polls, None, "the silent replica was never polled")
        assert "decode-0" in cluster.router.replica_ids(DECODE)  # silent is not dead: the view decides
    finally:
        ray.get(victim.handle.inject_fault.remote(), timeout=10)
    seen = victim.last_state_at
    wait_until(lambda: victim.last_state_at > seen, None, "pushes did not resume")
    run_requests(loop, cluster, [prompt(20)])
    wait_until(lambda: index_matches(cluster), None, "the index differs after pushes resumed")
    wait_for_baseline(loop, cluster)


def test_a_late_ingress_gets_a_snapshot_then_follows_the_pushes(loop, cluster):
    run_requests(loop, cluster, [prompt(30), prompt(31)])  # events it never saw pushed
    late = Dispatcher(Router(cluster.cfg.router, block_size=cluster.cfg.block_size), ingress_id="late")

    async def join():
        for members in cluster.dispatcher.members.values():
            for member in members.values():
                assert await late.add_replica(member.info, member.handle)
        late.start_following()

    loop.run(join(), timeout=60)
    try:
        wait_until(lambda: index_matches(cluster, late.router), None, "the late ingress's snapshot index differs")
        frames = late.pushed.num_frames
        run_requests(loop, cluster, [prompt(32), prompt(33)])
        wait_until(lambda: index_matches(cluster, late.router), None, "the late ingress missed pushed events")
        assert late.pushed.num_frames > frames and late.pushed.num_resyncs == 0
    finally:
        loop.run(late.close(), timeout=30)
    wait_for_baseline(loop, cluster)


def test_a_burst_loses_no_event(loop, cluster):
    pushed = cluster.dispatcher.pushed
    resyncs = pushed.num_resyncs
    prompts = [prompt(100 + i, blocks=2) for i in range(24)]
    run_requests(loop, cluster, prompts)
    wait_until(lambda: index_matches(cluster), None, "events of the burst are missing from the index")
    assert pushed.num_resyncs == resyncs  # applied event by event, not repaired by a snapshot
    wait_for_baseline(loop, cluster)


def test_a_replica_that_dies_mid_stream_leaves_routing_before_the_controller_acts(loop, cluster):
    victim = cluster.dispatcher.members[DECODE]["decode-1"]
    loop.run(cluster.controller.pause(), timeout=30)
    try:
        # Longer than the stream can last once its replica is killed (the model's context).
        long = SamplingParams(max_tokens=400, ignore_eos=True)

        async def stream_until_killed() -> tuple[int, BaseException | None]:
            tokens = 0
            try:
                async for chunk in cluster.generate(prompt(40, blocks=1), long, exclude_decode=("decode-0",)):
                    tokens += len(chunk.token_ids)
                    if tokens >= 4:
                        ray.kill(victim.handle, no_restart=True)
            except Exception as exc:  # the stream broke with its replica
                return tokens, exc
            return tokens, None

        started = time.monotonic()
        tokens, error = loop.run(stream_until_killed(), timeout=120)
        assert tokens >= 4 and error is not None, (tokens, error)
        wait_until(
            lambda: "decode-1" not in cluster.router.replica_ids(DECODE), None, "the dead replica is still routed"
        )
        print(f"dead replica out of this ingress's routing {time.monotonic() - started:.2f} s after its stream began")
        assert cluster.decode_pool.get("decode-1") is not None  # the paused controller has not acted
    finally:

        async def resume():
            cluster.controller.resume()

        loop.run(resume(), timeout=10)
    wait_until(lambda: cluster.decode_pool.get("decode-1") is None, None, "the controller did not drop it")
    wait_for_refill(cluster, DECODE, 2)
    run_requests(loop, cluster, [prompt(41), prompt(42)])
    wait_until(lambda: index_matches(cluster), None, "the replacement is not followed")
    wait_for_baseline(loop, cluster)
