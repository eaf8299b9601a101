"""The token path on local Ray (CPU, gloo), real actors and sockets: clients' ids are only
labels (#13 defect 2), a disconnect at any point frees every block on both sides at once (defect 3:
within a bound relative to the machine's speed at the moment, tests/helpers/cluster.py), errors reach clients short (defect 5), a lost ingress connection aborts its requests, and a
hung prefill is retried. The token stream's framing: test_token_stream.py.
Each measured figure is printed (docs/RELIABILITY.md quotes them)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import httpx
import pytest
import ray

from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.proto import load_stubs
from splitserve.proto.messages.poll_reply import PollReply
from tests.helpers.cluster import (
    HELD_S,
    LoopHttpServer,
    fail_fast_bound_s,
    serving_backend,
    wait_for_baseline,
)
from tests.helpers.model import engine_reference
from tests.helpers.request_path import GREEDY, LONG, SHARED, request_path_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
pb2, pb2_grpc = load_stubs()


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    with serving_backend(loop, request_path_config(tiny_model), tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def reference(tiny_model):
    return engine_reference(tiny_model)


def local_prefill(cluster, on: bool) -> None:
    """Route every request to decode's own prefill (on), or to the prefill pool (off)."""
    cluster.router.config = cluster.router.config.model_copy(update={"local_prefill_threshold": 10**6 if on else 0})


# ---- #13 defect 2: a client's id is a label ---------------------------------------------------


@pytest.mark.parametrize("path", ["remote-prefill", "local-prefill"])
def test_duplicate_grpc_request_ids_are_harmless(loop, cluster, grpc_port, reference, path):
    prompts = [SHARED + [7, 8, 9], SHARED + [7, 8, 10], SHARED + list(range(100, 120))]
    results: dict[tuple[int, int], list] = {}

    def call(case: int, index: int, max_tokens: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            request = pb2.GenerateRequest(
                token_ids=pb2.TokenIds(ids=prompts[index]),
                max_tokens=max_tokens,
                temperature=0,
                ignore_eos=True,
                request_id="same-id",
            )
            results[(case, index)] = list(pb2_grpc.SplitServeStub(channel).Generate(request, timeout=120))

    local_prefill(cluster, path == "local-prefill")
    try:
        # Sent simultaneously; 0.4 s apart while the first still streams; with shared prefixes.
        for case, gap_s, max_tokens in ((0, 0.0, 8), (1, 0.4, 48)):
            threads = [threading.Thread(target=call, args=(case, i, max_tokens)) for i in range(len(prompts))]
            for thread in threads:
                thread.start()
                time.sleep(gap_s)
            for thread in threads:
                thread.join(180)
            for i, prompt in enumerate(prompts):
                responses = results[(case, i)]
                assert all(r.request_id == "same-id" for r in responses)  # echoed back
                assert [t for r in responses for t in r.token_ids] == reference(prompt, max_tokens)
                assert responses[-1].finished and responses[-1].usage.completion_tokens == max_tokens
    finally:
        local_prefill(cluster, False)
    wait_for_baseline(loop, cluster)


# ---- #13 defect 3: a disconnect at any point frees every block at once ---------------------


def _freed_bound_s(cluster) -> float:
    """How soon a disconnect must have freed everything: fail_fast_bound_s of the slowest
    replica to answer now (1 s on this box when it is not overloaded)."""
    replicas = [r for pool in (cluster.prefill_pool, cluster.decode_pool) for r in pool.live_replicas()]
    return max(fail_fast_bound_s(r.handle) for r in replicas)


def _disconnect(loop, cluster, prompt, params, when, then=None) -> tuple[float, str]:
    """Start a request, cancel its consumer once `when` (an async callable getting a
    first-chunk event) returns, run `then` (async: switch off the fault that held the request
    there), then time until every replica is back to baseline."""
    bound_s = _freed_bound_s(cluster)

    async def scenario():
        first = asyncio.Event()

        async def consume():
            async for _ in cluster.generate(prompt, params, label="leaver"):
                first.set()

        task = asyncio.ensure_future(consume())
        await when(first)
        assert not task.done(), "the request ended before the disconnect"
        task.cancel()
        cancelled_at = time.monotonic()
        if then is not None:
            await then()
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        return cancelled_at, type(outcome).__name__

    cancelled_at, outcome = loop.run(scenario(), timeout=60)
    wait_for_baseline(loop, cluster, timeout_s=bound_s)
    return time.monotonic() - cancelled_at, outcome


def _sleep(seconds: float):
    async def when(_first):
        await asyncio.sleep(seconds)

    return when


def _transfer_done(cluster):
    """Until the decode replica has received a new transfer (the request now waits to be admitted)."""
    (decode,) = cluster.dispatcher.members[DECODE].values()

    async def received() -> int:
        return PollReply.from_bytes(await decode.handle.poll.remote()).transfer.num_blocks

    async def when(_first):
        before = await received()
        while await received() == before:
            await asyncio.sleep(0.01)

    return when


def _prefill_step_hung(cluster):
    """Until a prefill replica's engine step hangs on the armed fault (asked through Ray's
    __ray_call__: a hung engine loop cannot answer poll)."""
    replicas = cluster.prefill_pool.live_replicas()

    async def fired() -> int:
        return sum(await asyncio.gather(*(r.handle.__ray_call__.remote(_faults_fired) for r in replicas)))

    async def when(_first):
        before = await fired()
        while await fired() == before:
            await asyncio.sleep(0.01)

    return when


def _faults_fired(worker) -> int:  # runs in the replica
    return worker.loop.faults.num_fired


def _prefill_holding_blocks(cluster):
    """Until a prefill replica has prefilled and pins the blocks for their (stalled) transfer."""
    replicas = cluster.prefill_pool.live_replicas()

    async def pinned() -> int:
        replies = await asyncio.gather(*(r.handle.poll.remote() for r in replicas))
        return sum(PollReply.from_bytes(reply).num_pinned for reply in replies)

    async def when(_first):
        while not await pinned():
            await asyncio.sleep(0.01)

    return when


async def _first_chunk(first: asyncio.Event) -> None:
    await asyncio.wait_for(first.wait(), 30)


def _set_prefill_fault(cluster, **fault) -> None:
    ray.get([r.handle.inject_fault.remote(**fault) for r in cluster.prefill_pool.live_replicas()], timeout=10)


def _prefill_faults_off(cluster):
    async def then() -> None:
        await asyncio.gather(*(r.handle.inject_fault.remote() for r in cluster.prefill_pool.live_replicas()))

    return then


def _set_admission_delay(cluster, seconds: float) -> None:
    ray.get([r.handle.delay_admission.remote(seconds) for r in cluster.decode_pool.live_replicas()], timeout=10)


def test_a_disconnect_at_any_point_frees_every_block_at_once(loop, cluster):
    figures = {}
    wait_for_baseline(loop, cluster)
    long_prompt = SHARED + [(13 * i) % 400 + 20 for i in range(860)]  # the tiny model's context is 1024
    figures["before routing"] = _disconnect(loop, cluster, SHARED + [1, 2], LONG, _sleep(0))
    # Each fault below holds the request at its point until the disconnect (switching the fault
    # off ends the hang or stall), however fast or slow the machine.
    _set_prefill_fault(cluster, hang_s=HELD_S, hang_steps=1)
    try:
        figures["during prefill (900-token prompt)"] = _disconnect(
            loop, cluster, long_prompt, GREEDY, _prefill_step_hung(cluster), _prefill_faults_off(cluster)
        )
    finally:
        _set_prefill_fault(cluster)
    _set_prefill_fault(cluster, stall_send_s=HELD_S)
    try:
        figures["mid-transfer"] = _disconnect(
            loop,
            cluster,
            SHARED + list(range(50, 90)),
            LONG,
            _prefill_holding_blocks(cluster),
            _prefill_faults_off(cluster),
        )
    finally:
        _set_prefill_fault(cluster)
    _set_admission_delay(cluster, HELD_S)  # the disconnect cancels the wait
    try:
        figures["between transfer and admission"] = _disconnect(
            loop, cluster, SHARED + list(range(90, 130)), LONG, _transfer_done(cluster)
        )
    finally:
        _set_admission_delay(cluster, 0.0)
    figures["mid-stream"] = _disconnect(loop, cluster, SHARED + list(range(130, 170)), LONG, _first_chunk)
    for point, (seconds, outcome) in figures.items():
        print(f"disconnect {point}: every pool at baseline {seconds * 1000:.0f} ms after it ({outcome})")
        assert outcome == "CancelledError"
    # Nothing broke for the next request.
    assert len(loop.run(cluster.complete(SHARED + [5, 6], GREEDY), timeout=60)["token_ids"]) == GREEDY.max_tokens
    wait_for_baseline(loop, cluster)


def test_http_client_disconnect_mid_stream_frees_blocks(loop, cluster, backend):
    body = {"model": backend.model_name, "prompt": SHARED, "max_tokens": 400, "ignore_eos": True, "stream": True}
    bound_s = _freed_bound_s(cluster)
    with LoopHttpServer(loop, build_http_app(backend)) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                assert next(stream.iter_lines()).startswith("data: ")
            closed_at = time.monotonic()  # leaving the block closed the connection mid-stream
    wait_for_baseline(loop, cluster, timeout_s=bound_s)
    print(f"HTTP disconnect mid-stream: every pool at baseline {(time.monotonic() - closed_at) * 1000:.0f} ms later")


def test_lost_ingress_connection_aborts_its_requests(loop, cluster):
    """What decode sees when an ingress dies: its connection closes, and every request that
    came on it is aborted; the ingress fails what it had sent there."""
    (decode,) = cluster.dispatcher.members[DECODE].values()
    channel = decode.channel
    bound_s = _freed_bound_s(cluster)

    async def scenario():
        stream = cluster.generate(SHARED + [3, 3, 3], LONG, label="orphan")
        await anext(stream)
        connects = channel.num_connects
        channel._writer.transport.abort()  # the TCP connection drops, as when a process dies
        lost_at = time.monotonic()
        with pytest.raises(RequestError) as failed:
            async for _ in stream:
                pass
        return lost_at, connects, failed.value

    lost_at, connects, error = loop.run(scenario(), timeout=60)
    assert error.kind is ErrorKind.UNAVAILABLE and "went away" in error.message  # tokens were out: no retry
    wait_for_baseline(loop, cluster, timeout_s=bound_s)
    print(f"ingress connection lost: decode freed its blocks {(time.monotonic() - lost_at) * 1000:.0f} ms later")
    # The next request opens a new connection.
    assert loop.run(cluster.complete(SHARED + [4], GREEDY), timeout=60)["finish_reason"] == "length"
    assert channel.num_connects == connects + 1
    wait_for_baseline(loop, cluster)


# ---- #13 defect 5: errors reach clients short --------------------------------------------------


def test_errors_from_the_replicas_reach_clients_without_internals(loop, cluster, backend, grpc_port):
    validate = backend.validate
    backend.validate = lambda *args: None  # let a bad prompt through to the decode replica
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            request = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[1, 10**6]), max_tokens=2, request_id="bad")
            with pytest.raises(grpc.RpcError) as err:
                list(pb2_grpc.SplitServeStub(channel).Generate(request, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert "outside the vocabulary" in details and len(details) < 200
        for leak in ("Traceback", 'File "', "pid=", "actor", "ray."):
            assert leak not in details, details
    finally:
        backend.validate = validate
    wait_for_baseline(loop, cluster)


# ---- #13 defect 4: a hung prefill replica ---------------------------------------------------------


def test_a_hung_prefill_is_given_up_at_its_timeout_and_retried_on_another_replica(loop, cluster):
    for i in range(4):  # decode measures the prefill pool's speed on these
        loop.run(cluster.complete(SHARED + [400 + i, 7], GREEDY), timeout=60)
    wait_for_baseline(loop, cluster)
    hung, other = cluster.prefill_pool.get("prefill-0"), "prefill-1"
    retries = cluster.dispatcher.num_retries
    # Hung until the test switches the fault off: an answer at all means the retry did not wait for it.
    ray.get(hung.handle.inject_fault.remote(hang_s=HELD_S, hang_steps=1), timeout=10)
    cluster.router.set_draining(PREFILL, other, True)  # the first attempt goes to the hung replica

    async def go():
        task = asyncio.ensure_future(cluster.complete(SHARED + list(range(420, 460)), GREEDY))
        while not cluster.dispatcher.inflight_prefill:  # routed: let the retry have the other one
            await asyncio.sleep(0.005)
        cluster.router.set_draining(PREFILL, other, False)
        return await task

    started = time.monotonic()
    try:
        result = loop.run(go(), timeout=60)
        took = time.monotonic() - started
        (decode_id,) = cluster.dispatcher.members[DECODE]
        decode_handle = cluster.decode_pool.get(decode_id).handle  # asked while prefill-0 still hangs
        decode = PollReply.from_bytes(ray.get(decode_handle.poll.remote(), timeout=10)).engine
    finally:
        cluster.router.set_draining(PREFILL, other, False)
        ray.get(hung.handle.inject_fault.remote(), timeout=10)  # ends the hang
    assert result["prefill_replica"] == other and len(result["token_ids"]) == GREEDY.max_tokens
    assert cluster.dispatcher.num_retries == retries + 1
    # Decode gave the hung replica up at its timeout and freed the reservation then.
    assert decode.num_free_blocks == decode.num_blocks and not decode.num_running
    print(f"hung prefill: answered by {other} after a retry, {took:.2f} s after it was sent")
    wait_for_baseline(loop, cluster)  # the hung replica frees its side once the hang ends
