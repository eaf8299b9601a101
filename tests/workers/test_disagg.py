"""Disaggregated data path on local Ray (CPU, gloo): identical output to the colocated engine,
delta transfers, and failures that neither hang nor leak blocks."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from splitserve.cluster.request_error import RequestError
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import HELD_S, cluster_config, start_cluster, wait_for_baseline, wait_until

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
BS = 16


def mixed_prompts() -> list[list[int]]:
    # shorter than a block, exactly one block, exactly three blocks, and ragged lengths
    lengths = [3, 16, 48, 21, 70]
    return [[(7 * i + 3 * n) % 400 + 20 for i in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128))
    return {tuple(p): o.token_ids for p, o in zip(mixed_prompts(), engine.generate(mixed_prompts(), GREEDY))}


def run_all(loop, cluster, prompts, params=GREEDY):
    async def go():
        return await asyncio.gather(*(cluster.complete(p, params) for p in prompts))

    return loop.run(go(), timeout=180)


@pytest.fixture(scope="module")
def cluster_1p1d(ray_cluster, tiny_model, loop):
    cluster = start_cluster(loop, cluster_config(tiny_model))
    yield cluster
    loop.run(cluster.shutdown(), timeout=60)


def test_1p1d_matches_colocated(loop, cluster_1p1d, reference):
    results = run_all(loop, cluster_1p1d, mixed_prompts())
    for prompt, res in zip(mixed_prompts(), results):
        assert res["token_ids"] == reference[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert res["prefill_replica"] == "prefill-0"
    wait_for_baseline(loop, cluster_1p1d)


def test_delta_transfer_sends_only_missing_blocks(loop, cluster_1p1d):
    decode = cluster_1p1d.decode_pool.get("decode-0").handle
    shared = [100 + (i % 50) for i in range(3 * BS)]  # three full blocks
    first = shared + [11, 12, 13, 14, 15]
    second = shared + list(range(200, 200 + BS + 4))  # same prefix, 2 more blocks
    run_all(loop, cluster_1p1d, [first])
    before = PollReply.from_bytes(ray.get(decode.poll.remote())).transfer
    run_all(loop, cluster_1p1d, [second])
    after = PollReply.from_bytes(ray.get(decode.poll.remote())).transfer
    num_blocks = -(-len(second) // BS) - 3
    assert after.num_blocks - before.num_blocks == num_blocks
    kv = cluster_1p1d.decode_pool.engine_config
    bytes_per_block = 2 * 2 * BS * 2 * 16 * 4  # layers * (K,V) * block * kv_heads * head_dim * fp32
    assert after.num_bytes - before.num_bytes == num_blocks * bytes_per_block
    assert kv["block_size"] == BS
    wait_for_baseline(loop, cluster_1p1d)


def test_2p1d_matches_colocated_and_uses_both(loop, cluster_1p1d, reference):
    loop.run(cluster_1p1d.add_replicas(PREFILL, 1), timeout=120)
    try:
        results = run_all(loop, cluster_1p1d, mixed_prompts() * 2)
        for prompt, res in zip(mixed_prompts() * 2, results):
            assert res["token_ids"] == reference[tuple(prompt)]
        assert {r["prefill_replica"] for r in results} == {"prefill-0", "prefill-1"}
        wait_for_baseline(loop, cluster_1p1d)
    finally:
        loop.run(cluster_1p1d.drain_replica(PREFILL, "prefill-1"), timeout=60)


def test_idle_pairs_are_torn_down_and_reopened(loop, cluster_1p1d, reference):
    prompt = mixed_prompts()[1]
    run_all(loop, cluster_1p1d, [prompt])
    decode = cluster_1p1d.decode_pool.get("decode-0").handle
    loop.run(cluster_1p1d.controller.close_idle_pairs(0.0), timeout=30)
    assert ray.get(decode.close_idle_pairs.remote(0.0)) == []  # already closed
    result = run_all(loop, cluster_1p1d, [prompt])[0]  # a fresh pair, next epoch
    assert result["token_ids"] == reference[tuple(prompt)] and result["prefill_replica"] == "prefill-0"
    wait_for_baseline(loop, cluster_1p1d)


def test_colocated_mode_without_prefill_pool(ray_cluster, tiny_model, loop, reference):
    """prefill replicas = 0: decode replicas prefill locally (the colocated baseline)."""
    cluster = start_cluster(loop, cluster_config(tiny_model, num_prefill=0, num_decode=1))
    try:
        results = run_all(loop, cluster, mixed_prompts())
        for prompt, res in zip(mixed_prompts(), results):
            assert res["token_ids"] == reference[tuple(prompt)]
            assert res["prefill_replica"] is None
        wait_for_baseline(loop, cluster)
    finally:
        loop.run(cluster.shutdown(), timeout=60)


# ---- replicas killed mid-transfer: one 2P+1D cluster for both (each kill is replaced) ------
# Last in the file: the controller's replacements of the killed replicas load while the
# module tears down, not while the tests above run.


# Far longer than the controller takes to see a replica die: what frees the blocks of a dead
# decode replica's transfer must be that death, never the lease.
LEASE_S = 120.0


@pytest.fixture(scope="module")
def cluster_2p1d(ray_cluster, tiny_model, loop):
    cluster = start_cluster(loop, cluster_config(tiny_model, num_prefill=2, lease_s=LEASE_S))
    yield cluster
    loop.run(cluster.shutdown(), timeout=60)


def set_stall(cluster, stall_send_s: float, killed: str | None = None) -> None:
    """Every live prefill replica's sends stalled stall_send_s (0: not), but `killed`'s."""
    replicas = [r for r in cluster.prefill_pool.live_replicas() if r.replica_id != killed]
    ray.get([r.handle.inject_fault.remote(stall_send_s=stall_send_s) for r in replicas])


async def until_sending(replica_handle, timeout_s: float = 60.0) -> None:
    """Until the prefill replica has finished a prefill and holds its blocks for the transfer
    (pinned until decode acks): with a stalled sender, the request is then mid-transfer."""
    deadline = time.monotonic() + timeout_s
    while not PollReply.from_bytes(await replica_handle.poll.remote()).num_pinned:
        assert time.monotonic() < deadline, "the prefill never reached its KV send"
        await asyncio.sleep(0.01)


def test_prefill_killed_mid_prefill_is_retried_on_another(loop, cluster_2p1d, reference):
    cluster = cluster_2p1d
    retries = cluster.dispatcher.num_retries
    # Every send stalled until switched off: the victim's transfer is still under way at the
    # kill however slow the poll that finds it sending (a stall of seconds, a loaded machine
    # could outlast: the transfer then completed before the kill and nothing was retried).
    set_stall(cluster, HELD_S)
    chosen, killed = [], []

    async def go():
        prompt = mixed_prompts()[3]
        task = asyncio.ensure_future(_complete(cluster, prompt, chosen))
        while not chosen:
            await asyncio.sleep(0.005)
        victim = cluster.prefill_pool.get(chosen[0].prefill_replica)
        killed.append(victim)
        await until_sending(victim.handle)  # its send is stalled: kill it mid-transfer
        set_stall(cluster, 0.0, killed=victim.replica_id)  # the retry's prefill replica sends at once
        ray.kill(victim.handle)
        return await asyncio.wait_for(task, 60)

    try:
        result = loop.run(go(), timeout=90)
    finally:
        set_stall(cluster, 0.0, killed=chosen[0].prefill_replica if chosen else None)
    assert result["token_ids"] == reference[tuple(mixed_prompts()[3])]
    assert result["prefill_replica"] != chosen[0].prefill_replica
    assert cluster.dispatcher.num_retries == retries + 1
    # The retry no longer waits out a stall: the controller may not have dropped the victim yet.
    wait_until(lambda: all(r is not killed[0] for r in cluster.prefill_pool.live_replicas()), None, "victim still live")
    wait_for_baseline(loop, cluster)


def test_decode_killed_mid_transfer_fails_fast_and_frees_prefill_blocks(loop, cluster_2p1d):
    cluster = cluster_2p1d
    # The previous test's victim is replaced: both prefill replicas serve again.
    deadline = time.monotonic() + 180  # a safety net: a replacement loads its model first
    while len(cluster.router.replica_ids(PREFILL)) < 2:
        assert time.monotonic() < deadline, "the killed prefill replica was not replaced"
        time.sleep(0.1)
    (decode_id,) = cluster.router.replica_ids(DECODE)
    decode = cluster.decode_pool.get(decode_id).handle
    set_stall(cluster, HELD_S)  # until the test switches it off: the send waits out the kill
    chosen = []

    async def go():
        task = asyncio.ensure_future(_complete(cluster, mixed_prompts()[2], chosen))
        while not chosen:
            await asyncio.sleep(0.005)
        await until_sending(cluster.prefill_pool.get(chosen[0].prefill_replica).handle)
        ray.kill(decode)  # prefill done, its first send stalled
        return await asyncio.wait_for(task, 30)

    try:
        with pytest.raises(RequestError):  # at the death, not after the stall (it outlasts the test)
            loop.run(go(), timeout=60)
        # The send is still stalled and the lease far off: the prefill replica frees the
        # blocks it held for the dead replica because the controller told it that replica left.
        lease_ends = time.monotonic() + LEASE_S
        for replica in cluster.prefill_pool.live_replicas():
            while True:
                poll = PollReply.from_bytes(ray.get(replica.handle.poll.remote(), timeout=30))
                if poll.engine.num_free_blocks == poll.engine.num_blocks and not poll.num_pinned:
                    break
                assert time.monotonic() < lease_ends, (
                    f"prefill blocks held for the dead replica until the lease: {poll}"
                )
                time.sleep(0.05)
    finally:
        set_stall(cluster, 0.0)
    deadline = time.monotonic() + 60  # a safety net: the controller's next probe finds the death
    while decode_id in cluster.router.replica_ids(DECODE):
        assert time.monotonic() < deadline, "dead decode replica still routed"
        time.sleep(0.1)


async def _complete(cluster, prompt, chosen):
    tokens, last = [], None
    async for chunk in cluster.generate(prompt, GREEDY, on_route=chosen.append):
        tokens.extend(chunk.token_ids)
        last = chunk
    return {"token_ids": tokens, "prefill_replica": last.prefill_replica}
