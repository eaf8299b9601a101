"""The token stream on local Ray (CPU, gloo), real actors and sockets: one TokenBatch frame
per engine step, a reader that fell behind gets the queued steps as one chunk, and a second
ingress follows the same KV events (so both make the same prefix decisions)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from splitserve.cluster.ingress.dispatcher import Dispatcher
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import (
    pool_states,
    serving_backend,
    wait_for_baseline,
    wait_until,
)
from tests.helpers.model import engine_reference
from tests.helpers.request_path import GREEDY, SHARED, request_path_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    with serving_backend(loop, request_path_config(tiny_model), tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def reference(tiny_model):
    return engine_reference(tiny_model)


def test_tokens_travel_in_one_frame_per_engine_step(loop, cluster, reference):
    """Once six requests run together, each engine step's tokens of all six arrive in one frame."""
    (decode,) = cluster.dispatcher.members[DECODE].values()
    channel = decode.channel
    prompts = [SHARED + [200 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seen = [0] * len(prompts)
    counters: dict[str, tuple[int, int]] = {}

    async def one(i: int) -> list[int]:
        tokens = []
        async for chunk in cluster.generate(prompts[i], params):
            tokens += chunk.token_ids
            seen[i] = len(tokens)
            if "start" not in counters and min(seen) >= 2:  # all six are in the running batch
                counters["start"] = (channel.num_frames, channel.num_chunks)
            if "end" not in counters and min(seen) >= 30:
                counters["end"] = (channel.num_frames, channel.num_chunks)
        return tokens

    async def go():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    for prompt, tokens in zip(prompts, loop.run(go(), timeout=120)):
        assert tokens == reference(prompt, 40)
    num_frames = counters["end"][0] - counters["start"][0]
    num_chunks = counters["end"][1] - counters["start"][1]
    print(f"6 running streams: {num_chunks} chunks in {num_frames} frames")
    # ~6 chunks per frame: a step's tokens share one frame (a frame per request would make it 1).
    # A replica that falls behind sends several steps' tokens of a request as one chunk, so the
    # window's chunk count depends on the machine's load; their ratio to frames does not.
    assert num_frames >= 1
    assert num_frames * 4 <= num_chunks
    wait_for_baseline(loop, cluster)


def test_a_reader_that_falls_behind_gets_the_queued_steps_as_one_chunk(loop, cluster, reference):
    """Steps that queued while the ingress was busy elsewhere arrive as one chunk: the same
    tokens in order, logprobs still one per token, fewer events to render."""
    prompt = SHARED + [250]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=True)

    decodes = cluster.decode_pool.live_replicas()

    async def decode_busy() -> bool:
        replies = [PollReply.from_bytes(await r.handle.poll.remote()) for r in decodes]
        return any(r.engine.num_running or r.engine.num_waiting for r in replies)

    async def go():
        chunks = []
        async for chunk in cluster.generate(prompt, params):
            chunks.append(chunk)
            if len(chunks) == 2:
                while await decode_busy():  # the replica steps the request to its end meanwhile
                    await asyncio.sleep(0.01)
        return chunks

    chunks = loop.run(go(), timeout=120)
    assert [t for c in chunks for t in c.token_ids] == reference(prompt, 60)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    print(f"after a pause until decode finished: {[len(c.token_ids) for c in chunks[2:]]} tokens per chunk")
    assert len(chunks[2].token_ids) >= 5
    assert chunks[-1].finished and chunks[-1].num_output_tokens == 60
    assert sum(c.finished for c in chunks) == 1
    wait_for_baseline(loop, cluster)


def test_a_second_ingress_follows_the_same_kv_events(loop, cluster):
    follower = Dispatcher(Router(cluster.cfg.router, block_size=cluster.cfg.block_size), ingress_id="follower")

    async def follow():
        for members in cluster.dispatcher.members.values():
            for member in members.values():
                await follower.add_replica(member.info, member.handle)
        await follower.poll_once()

    prefixes = [[(17 * i + 5 * k) % 300 + 60 for i in range(32)] for k in range(4)]  # 2 blocks, one each

    def index_matches() -> bool:
        loop.run(follower.poll_once())
        for pool in (PREFILL, DECODE):
            for member in cluster.dispatcher.members[pool].values():
                _, hashes = ray.get(member.handle.snapshot.remote(), timeout=10)
                rid = member.info.replica_id
                if follower.router.index(pool).replica_hashes(rid) != set(hashes):
                    return False
                if cluster.router.index(pool).replica_hashes(rid) != set(hashes):
                    return False
        return True

    loop.run(follow(), timeout=60)
    try:
        for prefix in prefixes:  # new blocks stored while both follow, each prefix on one replica
            loop.run(cluster.complete(prefix + [9, 9], GREEDY), timeout=60)
        wait_until(index_matches, None, "the two ingresses' indexes differ from the replicas")
        # Both make the same prefix decision.
        for prefix in prefixes:
            a, b = cluster.router.route(prefix + [8]), follower.router.route(prefix + [8])
            assert (a.prefill_replica, a.prefill_cached_tokens) == (b.prefill_replica, b.prefill_cached_tokens)
            assert (a.decode_replica, a.decode_cached_tokens) == (b.decode_replica, b.decode_cached_tokens)
    finally:
        loop.run(follower.close(), timeout=30)
    assert pool_states(loop, cluster)  # the replicas serve on
    wait_for_baseline(loop, cluster)
