"""Engine-loop failures on real replicas (local Ray, CPU, gloo), through the production
ServingBackend, the OpenAI HTTP app (uvicorn, the `openai` client) and the gRPC frontend.

- An injected step failure, on decode and on prefill, fails only the requests of that batch,
  with a clear error, at the step that failed; the others finish; the loop serves on; pools at baseline.
- A loop that cannot carry on: the replica reports itself dead and releases its blocks; its
  requests fail fast; requests routed to it before it leaves are retried without spending
  the retry budget; it leaves routing at the next poll; the next 20 requests succeed; /health
  and gRPC health show the lost capacity, /metrics drops its series and counts one replica
  less -- until the controller's replacement (held back by its restart backoff, the replica
  died young, until the test ends the wait) is routable, and health is whole again."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import grpc
import httpx
import openai
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.cluster.frontend.grpc.health import READY_SERVICE, pool_service_name
from splitserve.cluster.frontend.grpc.server import GrpcFrontend
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.decode.decode_worker import PrefillFailedError
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_errors import EngineLoopStopped, EngineStepError
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.poll_reply import PollReply, ReplicaStatus
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.channel_stream import ChannelStream
from tests.helpers.cluster import (
    HELD_S,
    LoopHttpServer,
    cluster_config,
    fail_fast_bound_s,
    serving_backend,
    wait_for_baseline,
    wait_for_refill,
    wait_until,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def prompt(n: int, salt: int) -> list[int]:
    return [(13 * i + 7 * salt) % 400 + 20 for i in range(n)]


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    # A replica dying this young is a failed start to the controller: its replacement waits
    # restart_backoff_s -- until the test ends the wait (_replaced), once it saw the lost capacity.
    controller = {"restart_backoff_s": HELD_S, "restart_backoff_max_s": HELD_S, "healthy_after_s": 600.0}
    cfg = cluster_config(
        tiny_model, num_prefill=2, num_decode=2, policy="round-robin", lease_s=3.0, controller=controller
    )
    # One prompt per prefill step and two running sequences per decode step, so a failing step
    # has requests outside its batch to spare.
    cfg = cfg.model_copy(
        update={
            "prefill": cfg.prefill.model_copy(update={"max_num_seqs": 1}),
            "decode": cfg.decode.model_copy(update={"max_num_seqs": 2}),
        }
    )
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=64))
    return lambda ids, params=GREEDY: engine.generate([ids], params)[0].token_ids


def poll(handle) -> PollReply:
    return PollReply.from_bytes(ray.get(handle.poll.remote(), timeout=10))


# ---- a step fails: only its batch ----------------------------------------------------------


def test_step_failure_on_decode_fails_its_batch_and_the_loop_serves_on(loop, cluster, reference):
    decode = cluster.decode_pool.get("decode-0").handle
    running = [ChannelStream(loop, decode, f"long-{i}", prompt(20, i), LONG) for i in range(2)]
    wait_until(lambda: all(s.chunks for s in running), None, "the long requests did not start")
    waiting = [ChannelStream(loop, decode, f"short-{i}", prompt(20, 10 + i), GREEDY) for i in range(2)]
    wait_until(lambda: poll(decode).engine.num_waiting == 2, None, "the short requests are not queued")
    bound_s = fail_fast_bound_s(decode)
    armed = time.monotonic()
    ray.get(decode.inject_fault.remote(fail_steps=1))
    for stream in running:
        stream.wait(10)
        assert isinstance(stream.error, EngineStepError), stream.error
        assert "decode-0: engine step failed" in str(stream.error) and "injected step failure" in str(stream.error)
    took = max(s.ended_at for s in running) - armed
    print(f"decode step failure: both requests of the batch failed {took * 1000:.0f} ms after the fault")
    assert took < bound_s
    for i, stream in enumerate(waiting):  # not in that batch: they run next, unharmed
        assert stream.wait().error is None and stream.token_ids == reference(prompt(20, 10 + i))
    after = ChannelStream(loop, decode, "after", prompt(20, 20), GREEDY).wait()  # the loop serves on
    assert after.error is None and after.token_ids == reference(prompt(20, 20))
    assert poll(decode).is_serving
    wait_for_baseline(loop, cluster)


def test_step_failure_on_prefill_fails_its_batch_and_the_loop_serves_on(loop, cluster, reference):
    decode = cluster.decode_pool.get("decode-0").handle
    prefill = cluster.prefill_pool.get("prefill-0")
    warm = ChannelStream(loop, decode, "warm", prompt(40, 30), GREEDY, prefill).wait()  # opens the pair
    assert warm.error is None
    ray.get(prefill.handle.inject_fault.remote(fail_steps=1))
    bound_s = fail_fast_bound_s(prefill.handle)
    started = time.monotonic()
    # One prompt per prefill step (max_num_seqs 1): the first step fails one of them only.
    streams = [ChannelStream(loop, decode, f"p-{i}", prompt(40, 31 + i), GREEDY, prefill) for i in range(2)]
    for stream in streams:
        stream.wait()
    failed = [s for s in streams if s.error is not None]
    assert len(failed) == 1, [s.error for s in streams]
    error = failed[0].error
    assert isinstance(error, PrefillFailedError) and "prefill-0: engine step failed" in str(error)
    took = failed[0].ended_at - started
    print(f"prefill step failure: its request failed {took * 1000:.0f} ms after it was sent")
    assert took < bound_s
    ok = next(s for s in streams if s.error is None)
    assert ok.token_ids == reference(prompt(40, 31 + streams.index(ok)))
    again = ChannelStream(loop, decode, "p-again", prompt(40, 31 + streams.index(failed[0])), GREEDY, prefill).wait()
    assert again.error is None and again.token_ids == reference(prompt(40, 31 + streams.index(failed[0])))
    assert poll(prefill.handle).is_serving
    wait_for_baseline(loop, cluster)

    # Through the dispatcher the failed prefill is retried on the other prefill replica.
    ray.get(prefill.handle.inject_fault.remote(fail_steps=1))
    retries = cluster.dispatcher.num_retries
    cluster.router.set_draining(PREFILL, "prefill-1", True)  # the first attempt goes to prefill-0
    try:
        result = loop.run(cluster.complete(prompt(40, 40), GREEDY), timeout=60)
    finally:
        cluster.router.set_draining(PREFILL, "prefill-1", False)
    assert result["token_ids"] == reference(prompt(40, 40))
    assert cluster.dispatcher.num_retries == retries + 1
    wait_for_baseline(loop, cluster)


# ---- a loop that cannot carry on: the replica is dead ---------------------------------------


def _routing_lines(caplog, replica_id: str, since: float) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.endswith(("dispatcher", "routed_replicas")) and r.created >= since and replica_id in r.getMessage()
    ]


def _leaves_routing(loop, cluster, caplog, pool: str, replica_id: str) -> float:
    """Resume polling; seconds until replica_id is out of routing. Then checks it was said once."""
    since, started = time.time(), time.monotonic()
    resume_polling(loop, cluster)
    wait_until(lambda: replica_id not in cluster.router.replica_ids(pool), None, f"{replica_id} is still routed", 0.002)
    took = time.monotonic() - started
    time.sleep(1.0)  # ten more poll intervals: nothing more to say about it
    lines = _routing_lines(caplog, replica_id, since)
    assert len(lines) == 1 and "stopped serving" in lines[0], lines
    return took


def _check_lost_capacity(server_url: str, grpc_port: int, pool: str, replica_id: str, degraded: list[str]) -> None:
    """/health (HTTP and gRPC) names the pools short of their floor while /ready still says
    it serves; /metrics counts one replica less in `pool` and exports nothing of replica_id."""
    with httpx.Client(base_url=server_url, timeout=10) as http:
        resp = http.get("/health")
        assert resp.status_code == 503, resp.text
        body = resp.json()
        assert body["ok"] is False and body["degraded"] == degraded and f"the {pool} pool has 1" in body["reason"]
        assert body["pools"][pool].pop("kv_cache")["num_blocks"] > 0
        assert body["pools"][pool] == {"ok": False, "live": 1, "expected": 2, "min": 2, "tensor_parallel_size": 1}
        ready = http.get("/ready")  # degraded, but serving: what the probes read
        assert ready.status_code == 200 and ready.json()["serving"] is True
        metrics = http.get("/metrics").text
    assert re.search(rf'^splitserve_replicas\{{model_name="[^"]*",pool="{pool}"\}} 1\.0$', metrics, re.M), metrics
    assert f'replica="{replica_id}"' not in metrics  # its series are gone
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def status(service: str):
            return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

        assert status("") == NOT_SERVING and status(READY_SERVICE) == SERVING
        for name in (PREFILL, DECODE):
            assert status(pool_service_name(name)) == (NOT_SERVING if name in degraded else SERVING)


def _twenty_requests(server_url: str, backend) -> None:
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(20):
        done = client.completions.create(
            model=backend.model_name, prompt=prompt(24, 60 + i), max_tokens=4, temperature=0
        )
        assert done.usage.completion_tokens == 4 and done.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def frontends(loop, backend):
    grpc_frontend = GrpcFrontend(backend, health_poll_interval_s=0.2)
    port = loop.run(grpc_frontend.start("127.0.0.1", 0))
    with LoopHttpServer(loop, build_http_app(backend)) as http:
        yield http.url, port
    loop.run(grpc_frontend.stop(1.0))


def test_a_dead_decode_loop_leaves_routing_and_its_requests_are_retried(loop, cluster, backend, frontends, caplog):
    caplog.set_level(logging.WARNING, logger="splitserve.cluster.ingress.dispatcher")
    url, grpc_port = frontends
    decode_health = httpx.get(f"{url}/health").json()["pools"][DECODE]
    assert decode_health.pop("kv_cache")["num_blocks"] > 0
    assert decode_health == {"ok": True, "live": 2, "expected": 2, "min": 2, "tensor_parallel_size": 1}
    victim = cluster.decode_pool.get("decode-1")
    # It stays routed while we send requests to it: this ingress does not poll, the controller
    # does not probe (it would drop it from the view first).
    loop.run(cluster.dispatcher.stop_following())
    loop.run(cluster.controller.pause())
    cluster.dispatcher.max_retries = 0  # a dead replica must not need the budget
    try:
        holding = ChannelStream(loop, victim.handle, "holding", prompt(40, 50), LONG)  # holds blocks when it dies
        wait_until(lambda: holding.chunks, None, "the request on the victim did not start")
        bound_s = fail_fast_bound_s(victim.handle)
        stopped_at = time.monotonic()
        ray.get(victim.handle.inject_fault.remote(stop_loop=True))
        holding.wait(10)
        took = holding.ended_at - stopped_at
        print(f"dead decode loop: its running request failed {took * 1000:.0f} ms after the stop")
        assert took < bound_s and isinstance(holding.error, EngineLoopStopped), holding.error
        state = poll(victim.handle)
        assert state.status is ReplicaStatus.LOOP_STOPPED and "injected loop stop" in state.error
        assert state.engine.num_free_blocks == state.engine.num_blocks  # it released what it held

        # Still routed (no poll yet): round-robin sends every other request there; none fails.
        retries = cluster.dispatcher.num_retries
        results = complete_all(loop, cluster, [prompt(24, 70 + i) for i in range(4)])
        assert all(len(r["token_ids"]) == GREEDY.max_tokens for r in results)
        assert cluster.dispatcher.num_retries > retries  # they did hit it, and were retried

        bound_s = fail_fast_bound_s(victim.handle)
        took = _leaves_routing(loop, cluster, caplog, DECODE, victim.replica_id)
        print(f"dead decode loop: out of routing {took * 1000:.0f} ms after polling resumed (interval 100 ms)")
        assert took < bound_s
    finally:
        cluster.dispatcher.max_retries = 1
        resume_polling(loop, cluster)
        resume_controller(loop, cluster)
    wait_until(lambda: cluster.decode_pool.get(victim.replica_id) is None, None, "the controller still lists it")
    _check_lost_capacity(url, grpc_port, DECODE, victim.replica_id, degraded=[DECODE])
    _twenty_requests(url, backend)
    wait_until(lambda: _actor_gone(victim.handle), None, "the dead replica's actor was not shut down")
    _replaced(loop, cluster, url, DECODE)
    wait_for_baseline(loop, cluster)


def test_a_dead_prefill_loop_leaves_routing_and_its_requests_are_retried(loop, cluster, backend, frontends, caplog):
    caplog.set_level(logging.WARNING, logger="splitserve.cluster.ingress.dispatcher")
    url, grpc_port = frontends
    victim = cluster.prefill_pool.get("prefill-1")
    loop.run(cluster.dispatcher.stop_following())
    loop.run(cluster.controller.pause())
    cluster.dispatcher.max_retries = 0
    try:
        ray.get(victim.handle.inject_fault.remote(stop_loop=True))
        wait_until(lambda: not poll(victim.handle).is_serving, None, "the prefill loop did not stop")
        state = poll(victim.handle)
        assert state.engine.num_free_blocks == state.engine.num_blocks and state.num_pinned == 0
        retries = cluster.dispatcher.num_retries
        results = complete_all(loop, cluster, [prompt(24, 80 + i) for i in range(4)])
        assert all(r["prefill_replica"] == "prefill-0" for r in results)
        assert cluster.dispatcher.num_retries > retries
        bound_s = fail_fast_bound_s(victim.handle)
        took = _leaves_routing(loop, cluster, caplog, PREFILL, victim.replica_id)
        print(f"dead prefill loop: out of routing {took * 1000:.0f} ms after polling resumed (interval 100 ms)")
        assert took < bound_s
    finally:
        cluster.dispatcher.max_retries = 1
        resume_polling(loop, cluster)
        resume_controller(loop, cluster)
    wait_until(lambda: cluster.prefill_pool.get(victim.replica_id) is None, None, "the controller still lists it")
    _check_lost_capacity(url, grpc_port, PREFILL, victim.replica_id, degraded=[PREFILL])
    _twenty_requests(url, backend)
    _replaced(loop, cluster, url, PREFILL)
    wait_for_baseline(loop, cluster)


def _replaced(loop, cluster, server_url: str, pool: str) -> None:
    """End the pool's restart backoff: the controller's replacement becomes routable and health
    is whole again."""

    async def end_backoff() -> None:  # on the loop the controller runs on
        cluster.controller.backoff[pool].next_start_at = float("-inf")

    loop.run(end_backoff(), timeout=10)
    wait_for_refill(cluster, pool, 2)
    assert httpx.get(f"{server_url}/health", timeout=10).json()["ok"] is True


def complete_all(loop, cluster, prompts: list[list[int]]) -> list[dict]:
    async def go():
        return await asyncio.gather(*(cluster.complete(p, GREEDY) for p in prompts))

    return loop.run(go(), timeout=120)


def resume_controller(loop, cluster) -> None:
    async def resume() -> None:  # it needs the cluster's running loop
        cluster.controller.resume()

    loop.run(resume(), timeout=10)


def resume_polling(loop, cluster) -> None:
    async def start() -> None:  # start_following needs the cluster's running loop
        cluster.dispatcher.start_following()

    loop.run(start(), timeout=10)


def _actor_gone(handle) -> bool:
    try:
        ray.get(handle.ready.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False
