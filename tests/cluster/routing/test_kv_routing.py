"""The KV-aware router on a live 2P+1D cluster: requests sharing a long prefix go to the
prefill replica that holds it (and hit its cache); round-robin does not. The same with
simulated engines (engine: simulated)."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.cluster.routing.replica_pools import PREFILL
from splitserve.engine.core.block_hash import hash_blocks
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import cluster_config, start_cluster, wait_for_baseline

pytestmark = pytest.mark.ray
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PREFIX_LEN = 128  # eight full blocks: its credit outweighs one in-flight request (running_weight 64)


def groups(salt: int = 0) -> dict[int, list[list[int]]]:
    """Three prefix groups; another salt gives prefixes no replica has cached yet."""
    out = {}
    for g in range(3):
        prefix = [(31 * g + 7 * i + 101 * salt) % 300 + 50 for i in range(PREFIX_LEN)]
        out[g] = [prefix + [400 + g, 410 + s, 420 + s, 430 + s, 440, 441, 442, 443] for s in range(4)]
    return out


async def wait_until_indexed(cluster, salt: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for prompts in groups(salt).values():
        hashes = hash_blocks(prompts[0], 16)[: PREFIX_LEN // 16]
        while max(cluster.router.index(PREFILL).prefix_match(hashes).values(), default=0) < len(hashes):
            assert time.monotonic() < deadline, "warm-up prefixes never reached the router's index"
            await asyncio.sleep(0.05)


def run_workload(loop, cluster, salt: int) -> dict[int, list[dict]]:
    """First request of each group warms a replica; the rest follow once the index knows."""
    results: dict[int, list[dict]] = {g: [] for g in groups(salt)}

    async def go():
        for g, prompts in groups(salt).items():
            results[g].append(await cluster.complete(prompts[0], PARAMS))
        await wait_until_indexed(cluster, salt)  # KV events reach the router through the poller
        for g, prompts in groups(salt).items():
            for p in prompts[1:]:
                results[g].append(await cluster.complete(p, PARAMS))

    loop.run(go(), timeout=180)
    return results


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model, loop):
    """One 2P+1D cluster for both policies: each parameter installs a fresh router with its
    policy (restart_router, as after a router crash) and sends its own prefixes."""
    cluster = start_cluster(loop, cluster_config(tiny_model, num_prefill=2))
    yield cluster
    loop.run(cluster.shutdown(), timeout=60)


def use_policy(loop, cluster, policy: str) -> None:
    router = cluster.cfg.router.model_copy(update={"policy": policy})
    cluster.cfg = cluster.cfg.model_copy(update={"router": router})
    loop.run(cluster.restart_router(), timeout=60)


POLICIES = ["kv", "round-robin"]


@pytest.mark.parametrize("policy", POLICIES)
def test_prefix_groups_follow_their_cache(cluster, loop, policy):
    use_policy(loop, cluster, policy)
    try:
        results = run_workload(loop, cluster, salt=POLICIES.index(policy))
        followers = [r for g in results.values() for r in g[1:]]
        cached = sum(r["num_cached_tokens"] for r in followers)
        if policy == "kv":
            for g, rs in results.items():
                holder = rs[0]["prefill_replica"]
                assert all(r["prefill_replica"] == holder for r in rs[1:]), f"group {g} left its replica"
            assert cached == PREFIX_LEN * len(followers)
            assert cluster.router.decision_counts().get("kv-prefix", 0) >= len(followers)
        else:
            assert cached < PREFIX_LEN * len(followers)
            replicas = {r["prefill_replica"] for g in results.values() for r in g}
            assert replicas == {"prefill-0", "prefill-1"}
        wait_for_baseline(loop, cluster)
    finally:
        use_policy(loop, cluster, "kv")


def check_kv_routing(loop, cluster, results: dict[int, list[dict]]) -> None:
    followers = [r for g in results.values() for r in g[1:]]
    for g, rs in results.items():
        holder = rs[0]["prefill_replica"]
        assert all(r["prefill_replica"] == holder for r in rs[1:]), f"group {g} left its replica"
    assert sum(r["num_cached_tokens"] for r in followers) == PREFIX_LEN * len(followers)
    assert cluster.router.decision_counts().get("kv-prefix", 0) >= len(followers)


def test_prefix_groups_follow_their_cache_on_simulated_engines(ray_cluster, tiny_model, loop):
    """The simulated engine (the same scheduler, prefix cache and KV events, no forward) routes
    alike: its own 2P+1D cluster, since the engine is fixed when the replicas start."""
    cfg = cluster_config(tiny_model, num_prefill=2, policy="kv", engine="simulated", engine_profile="llama-8b-h200")
    cluster = start_cluster(loop, cfg)
    try:
        check_kv_routing(loop, cluster, run_workload(loop, cluster, salt=len(POLICIES)))
        wait_for_baseline(loop, cluster)
    finally:
        loop.run(cluster.shutdown(), timeout=60)
