"""The host KV tier on real replicas (local Ray, CPU): a multi-turn workload on device pools too
small for it gives the colocated engine's greedy tokens with the tier on, through the
disaggregated path and decode's local prefill, with both pools serving host hits by loading;
the router indexes each replica's tiers from its KV events and routes to a host hit over a
miss; cancellations and a killed replica leave every pool at baseline."""

from __future__ import annotations

import asyncio

import pytest
import ray

from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.core.block_hash import hash_blocks
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.kv_events import HOST
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import cluster_config, pool_states, start_cluster, wait_for_baseline, wait_until

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SYSTEM = [(5 * i) % 300 + 40 for i in range(24)]


def _turn(conv: int, turn: int) -> list[int]:
    return [(11 * conv + 7 * turn + 3 * i) % 300 + 60 for i in range(13)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=256))


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model, loop):
    cfg = cluster_config(tiny_model, num_prefill=1, num_decode=2, policy="kv", num_blocks=12, kv_offloading_size=0.002)
    cluster = start_cluster(loop, cfg)
    yield cluster
    loop.run(cluster.shutdown(), timeout=60)


def _chat(loop, cluster, reference, convs: range, num_turns: int = 3, indexed_in: str | None = None) -> list[dict]:
    """Conversations one turn at a time, each turn re-sending the history; every answer is
    checked against the colocated engine without a tier. indexed_in: a pool whose router index
    must hold each answered prompt (either tier, on some replica) before the next request, so
    that a loaded machine's late KV events never route a turn away from its history."""
    history = {c: list(SYSTEM) for c in convs}
    results = []
    for turn in range(num_turns):
        for c in convs:
            history[c] += _turn(c, turn)
            res = loop.run(cluster.complete(history[c], GREEDY), timeout=60)
            assert res["token_ids"] == reference.generate([history[c]], GREEDY)[0].token_ids, (c, turn)
            if indexed_in is not None:
                hashes = hash_blocks(history[c], 16)
                index = cluster.router.index(indexed_in)
                wait_until(
                    lambda index=index, hashes=hashes: (
                        max(index.tiered_prefix_match(hashes)[1].values(), default=0) >= len(hashes)
                    ),
                    None,
                    f"conversation {c}'s turn {turn} is not indexed in {indexed_in}",
                )
            history[c] += res["token_ids"]
            results.append(res)
    return results


def _host_loads(loop, cluster) -> dict[str, int]:
    return {rid: s.engine.host_loaded_blocks for rid, s in pool_states(loop, cluster).items()}


def test_disaggregated_multi_turn_matches_and_both_pools_load(loop, cluster, reference):
    results = _chat(loop, cluster, reference, range(8))
    assert all(r["prefill_replica"] == "prefill-0" for r in results)  # nothing local here
    states = wait_for_baseline(loop, cluster)
    prefill = states["prefill-0"].engine
    assert prefill.host_loaded_blocks > 0 and prefill.host_stored_blocks > 0
    # Decode evicted history to its host tier too. Whether a later turn lands where its history
    # is depends on the router's load terms; decode loading into a reservation is checked
    # deterministically in tests/engine/test_host_kv_tier.py, and from a real replica below.
    assert sum(s.engine.host_stored_blocks for rid, s in states.items() if rid.startswith("decode")) > 0
    for state in states.values():  # a replica the router sent no long history to stored nothing
        assert state.engine.host_num_used_blocks <= state.engine.host_num_blocks
        assert (state.engine.host_num_used_blocks > 0) == (state.engine.host_stored_blocks > 0)
    # Later turns were served from cache (device or host), not recomputed.
    assert sum(r["num_cached_tokens"] for r in results[8:]) > 0


def test_local_prefill_reuses_decodes_host_blocks(loop, cluster, reference):
    saved = cluster.router.config
    cluster.router.config = RouterConfig(policy="kv", local_prefill_threshold=100_000)  # always local
    try:
        before = _host_loads(loop, cluster)
        results = _chat(loop, cluster, reference, range(10, 18), indexed_in=DECODE)
        assert all(r["prefill_replica"] is None for r in results)
        after = _host_loads(loop, cluster)
        assert after["prefill-0"] == before["prefill-0"]
        assert sum(after[r] - before[r] for r in after if r.startswith("decode")) > 0
    finally:
        cluster.router.config = saved
    wait_for_baseline(loop, cluster)


def test_router_indexes_both_tiers_from_real_events(loop, cluster):
    router = cluster.router

    def index_matches_snapshots():
        for pool in (PREFILL, DECODE):
            for replica in cluster.pools[pool].live_replicas():
                seq, device, host = ray.get(replica.handle.snapshot.remote(), timeout=10)
                index = router.index(pool)
                if index.replica_hashes(replica.replica_id) != frozenset(device):
                    return False
                if index.num_blocks(replica.replica_id, HOST) != len(host):
                    return False
        return True

    wait_until(index_matches_snapshots, None, "the router's tiers differ from the replicas' snapshots")
    assert router.index(PREFILL).num_indexed_host_hashes > 0


def test_router_credits_a_host_hit_and_the_replica_loads_it(loop, cluster, reference):
    prompt = [(13 * i) % 300 + 70 for i in range(49)]  # 3 full blocks + 1
    loop.run(cluster.complete(prompt, GREEDY), timeout=60)
    for seed in (1, 2):  # push it out of prefill's 12-block device pool, into its host tier
        loop.run(cluster.complete([(seed * 37 + 17 * i) % 300 + 50 for i in range(170)], GREEDY), timeout=60)
    hashes = hash_blocks(prompt, 16)
    index = cluster.router.index(PREFILL)

    def evicted_to_host():
        device, either = index.tiered_prefix_match(hashes)
        return (
            (device.get("prefill-0", 0),) if device.get("prefill-0", 0) < 3 and either.get("prefill-0") == 3 else None
        )

    # The replica evicted them; the ingress sees it once it polled the KV events.
    (on_device,) = wait_until(evicted_to_host, None, "the prompt's blocks are not indexed in prefill's host tier")
    decision = cluster.router.route(prompt)
    decision.release_claims()
    assert decision.prefill_replica == "prefill-0" and decision.prefill_cached_tokens == 48
    assert decision.prefill_host_cached_tokens == 16 * (3 - on_device)
    before = _host_loads(loop, cluster)["prefill-0"]
    res = loop.run(cluster.complete(prompt, GREEDY), timeout=60)
    assert res["token_ids"] == reference.generate([prompt], GREEDY)[0].token_ids
    assert _host_loads(loop, cluster)["prefill-0"] > before
    wait_for_baseline(loop, cluster)


def test_cancelled_requests_free_their_loaded_blocks(loop, cluster):
    histories = [list(SYSTEM) + _turn(c, 0) + [c] for c in range(4)]  # host hits on both pools
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def cancel_after(ids, delay):
        task = asyncio.ensure_future(cluster.complete(ids, long))
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def go():
        await asyncio.gather(*(cancel_after(ids, d) for ids, d in zip(histories, (0, 0.001, 0.01, 0.05))))

    loop.run(go(), timeout=60)
    wait_for_baseline(loop, cluster)


def test_a_killed_replica_leaves_the_index_and_the_rest_at_baseline(loop, cluster, reference):
    victim = cluster.decode_pool.get("decode-1")
    assert victim is not None
    ray.kill(victim.handle)
    wait_until(lambda: "decode-1" not in cluster.router.replica_ids(DECODE), None, "the dead replica is still routed")
    assert cluster.router.index(DECODE).num_blocks("decode-1", HOST) == 0
    wait_until(lambda: cluster.decode_pool.get("decode-1") is None, None, "the controller still lists the dead replica")
    _chat(loop, cluster, reference, range(20, 22), num_turns=2)  # still serves, same tokens
    wait_for_baseline(loop, cluster)
