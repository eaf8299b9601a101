"""Many simulated replicas on one box: a cluster of n replicas (torch-free, no weights, no CPU
reserved each) starts, serves concurrent requests across its decode replicas, scales down by
draining half of them, and shuts down without leaving an actor of the app behind. 4 replicas
in the default run; 32 under `slow`."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.worker_pool import named_actors
from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import start_cluster, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
PARAMS = SamplingParams(max_tokens=6)


def simulated_config(model: str, num_prefill: int, num_decode: int) -> ServeConfig:
    pool = {"num_kv_blocks": 64, "resources": {"num_cpus": 0}}
    return ServeConfig.model_validate(
        {
            "model": model,
            "engine": "simulated",
            "engine_profile": "llama-8b-h200",
            "prefill": {"replicas": num_prefill, **pool},
            "decode": {"replicas": num_decode, **pool},
            "router": {"policy": "kv", "local_prefill_threshold": 0},
        }
    )


@pytest.mark.parametrize(
    "num_prefill,num_decode",
    [(2, 2), pytest.param(8, 24, marks=pytest.mark.slow)],
    ids=["4-replicas", "32-replicas"],
)
def test_a_simulated_cluster_starts_serves_scales_down_and_leaves_nothing(
    ray_cluster, tiny_model, loop, num_prefill, num_decode
):
    cluster = start_cluster(loop, simulated_config(tiny_model, num_prefill, num_decode))
    namespace = cluster.controller.namespace
    try:
        assert len(named_actors(namespace)) == num_prefill + num_decode
        prompts = [[(7 * i + k) % 500 + 10 for k in range(40)] for i in range(3 * num_decode)]

        async def serve_all():
            return await asyncio.gather(*(cluster.complete(p, PARAMS) for p in prompts))

        results = loop.run(serve_all(), timeout=600)
        assert all(len(r["token_ids"]) == PARAMS.max_tokens for r in results)
        assert len({r["prefill_replica"] for r in results}) > 1
        decode_ids = cluster.router.replica_ids(DECODE)
        leaving = decode_ids[: num_decode // 2]

        async def scale_down():
            return await asyncio.gather(*(cluster.drain_replica(DECODE, rid, 120) for rid in leaving))

        assert all(loop.run(scale_down(), timeout=300))
        assert set(cluster.router.replica_ids(DECODE)) == set(decode_ids) - set(leaving)
        assert len(named_actors(namespace)) == num_prefill + num_decode - len(leaving)
        again = loop.run(serve_all(), timeout=600)  # the rest still serve
        assert all(len(r["token_ids"]) == PARAMS.max_tokens for r in again)
        wait_for_baseline(loop, cluster, timeout_s=60)
    finally:
        loop.run(cluster.shutdown(), timeout=300)
    assert named_actors(namespace) == []
