"""A served tensor-parallel replica is a gang of Ray rank actors (real actors, gloo on CPU, the
OpenAI SDK over HTTP): a TP-2 decode pool (prefilling its own prompts) answers greedy requests
with the TP-1 engine's text; killing one follower rank replaces the whole replica and the next
request is served with the pools back at baseline; a gang no node can hold fails its start with
a message naming the need while the server keeps answering /health."""

from __future__ import annotations

import httpx
import pytest
import ray

from splitserve.cluster.config import PoolResources, ServeConfig
from splitserve.cluster.control.worker_pool import named_actors
from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import serving_backend, wait_for_baseline, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog."]
CONTROLLER = {"probe_interval_s": 0.2, "restart_backoff_s": 0.5, "restart_backoff_max_s": 1.0}


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    pool = {"num_kv_blocks": 64, "resources": {"num_cpus": 1}, "torch_threads": 1, "tensor_parallel_size": 2}
    cfg = ServeConfig.model_validate(
        {
            "model": tiny_model,
            "prefill": {**pool, "replicas": 0},
            "decode": {**pool, "replicas": 1},
            "controller": CONTROLLER,
        }
    )
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=64))


def complete(client, backend, prompt: str) -> str:
    out = client.completions.create(
        model=backend.model_name, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def the_decode_replica(backend):
    (replica,) = backend.cluster.decode_pool.live_replicas()
    return replica


def test_tp2_greedy_text_over_http_equals_tp1(client, backend, offline):
    replica = the_decode_replica(backend)
    assert replica.gang is not None and replica.gang.size == 2 and len(replica.gang.followers) == 1
    assert all(replica.gang.nodes) and len(set(replica.gang.nodes)) == 1  # STRICT_PACK: one node
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt in PROMPTS:
        expected = offline.generate([offline.tokenize(prompt)], params)[0].text
        assert complete(client, backend, prompt) == expected


def test_losing_a_follower_rank_replaces_the_whole_replica(loop, client, backend, offline):
    old = the_decode_replica(backend)
    namespace = backend.cluster.decode_pool.namespace
    ray.kill(old.gang.followers[0], no_restart=True)
    new = wait_until(
        lambda: next((r for r in backend.cluster.decode_pool.live_replicas() if r.replica_id != old.replica_id), None),
        None,
        "no replacement decode replica",
        interval_s=0.2,
    )
    assert new.gang is not None and new.gang.size == 2
    gone = {old.replica_id, f"{old.replica_id}-rank-1"}
    wait_until(lambda: not gone & set(named_actors(namespace)), None, "the old gang's actors still run")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = offline.generate([offline.tokenize(PROMPTS[0])], params)[0].text
    assert complete(client, backend, PROMPTS[0]) == expected
    wait_for_baseline(loop, backend.cluster)
    assert [r.replica_id for r in backend.cluster.decode_pool.live_replicas()] == [new.replica_id]


def test_a_gang_no_node_can_hold_stays_pending_naming_its_need_and_health_answers(server, backend):
    health = httpx.get(f"{server.url}/health", timeout=10).json()["pools"]["decode"]
    assert health["tensor_parallel_size"] == 2
    ((replica_id, nodes),) = health["ranks"].items()
    assert replica_id == the_decode_replica(backend).replica_id and len(nodes) == 2
    controller, pool = backend.cluster.controller, backend.cluster.decode_pool
    saved = (pool.resources, pool.placement_timeout_s)
    pool.resources, pool.placement_timeout_s = PoolResources(num_cpus=5), 1.0  # 2 ranks x 5 > the node's 8
    controller.targets[DECODE] += 1
    need = "decode replica needs 10 CPUs on one node (tensor_parallel_size 2)"
    try:
        wait_until(
            lambda: need in httpx.get(f"{server.url}/health", timeout=10).json()["pools"]["decode"].get("pending", ""),
            None,
            "/health does not show the pending replica's need",
            interval_s=0.5,
        )
    finally:
        controller.targets[DECODE] -= 1
        pool.resources, pool.placement_timeout_s = saved
    wait_until(lambda: len(pool.replicas) == 1, None, "the pending replica was not given up", interval_s=0.2)
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["serving"] and health["decode_replicas"] == 1
