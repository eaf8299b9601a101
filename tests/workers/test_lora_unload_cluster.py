"""Unloading a LoRA adapter that a request is using, on real replicas (local Ray, CPU, 1P+1D,
every prompt prefilled remotely), through the controller (cluster/control/lora_adapter_control.py):
the policy is to wait. The deployment starts with no adapter and loads it at runtime. With decode slowed so the request is still running, an unload whose
timeout passes first is 409: the adapter is served again on every replica and in the ingress's
view, and the request finishes with transformers + peft's tokens. An unload that may wait
returns once the request finished (with peft's tokens, never failed), and then the adapter is
gone everywhere: the view, every replica (it loads again), the pools' engine config. The pools
end at baseline."""

from __future__ import annotations

import asyncio

import pytest
import ray

from splitserve.proto.messages.sampling_params import SamplingParams
from tests.cluster import test_lora_serving
from tests.cluster.test_lora_serving import MAX_TOKENS, PROMPT
from tests.helpers.cluster import cluster_config, pool_states, start_cluster, wait_for_baseline, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
checkpoint = test_lora_serving.checkpoint  # the base, its three adapters and peft's tokens
SQL = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, lora_adapter="sql")
HANG_S = 0.4  # each decode step: the request stays in flight for seconds


def test_unload_waits_for_the_adapters_request_or_gives_up_with_409(ray_cluster, loop, checkpoint):
    base, adapters, expected = checkpoint
    modules = {"sql": str(adapters["sql"])}
    cfg = cluster_config(str(base), enable_lora=True, max_loras=2, max_lora_rank=16)  # no adapter at start
    cluster = start_cluster(loop, cfg)
    controller = cluster.controller
    try:
        assert loop.run(cluster.load_lora_adapter("sql", modules["sql"]), timeout=120)[0] == 200
        assert cluster.follower.view.lora_adapters == ["sql"]  # applied before the load answered
        (decode,) = cluster.decode_pool.live_replicas()

        def running_on_decode() -> bool:
            return pool_states(loop, cluster)[decode.replica_id].engine.num_running == 1

        async def unload_during_request(timeout_s: float):
            request = asyncio.ensure_future(cluster.complete(PROMPT, SQL))
            while not await asyncio.to_thread(running_on_decode):
                assert not request.done(), request.result()
            outcome = await controller.unload_lora_adapter("sql", timeout_s)
            finished_first = request.done()
            return outcome, finished_first, await request

        ray.get(decode.handle.inject_fault.remote(hang_s=HANG_S, hang_steps=10**6), timeout=30)
        (status, message), _, result = loop.run(unload_during_request(0.2), timeout=120)
        assert status == 409 and "still in use" in message, message
        assert result["token_ids"] == expected["sql"]
        assert controller.roster.lora_adapters == ["sql"]
        wait_until(lambda: cluster.follower.view.lora_adapters == ["sql"], None, "the ingress's view lacks sql")
        assert loop.run(cluster.complete(PROMPT, SQL), timeout=120)["token_ids"] == expected["sql"]

        (status, message), finished_first, result = loop.run(unload_during_request(60.0), timeout=180)
        assert status == 200, message
        assert finished_first and result["token_ids"] == expected["sql"]
        ray.get(decode.handle.inject_fault.remote(), timeout=30)
        assert controller.roster.lora_adapters == []
        assert cluster.follower.view.lora_adapters == []
        assert all("sql" not in pool.engine_config["lora_modules"] for pool in controller.pools.values())
        # Every replica let it go: loading it again is accepted by each of them.
        assert loop.run(cluster.load_lora_adapter("sql", modules["sql"]), timeout=120)[0] == 200
        assert loop.run(cluster.complete(PROMPT, SQL), timeout=120)["token_ids"] == expected["sql"]
        wait_for_baseline(loop, cluster)
    finally:
        loop.run(cluster.shutdown(), timeout=60)
