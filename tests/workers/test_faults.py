"""Fault injection on local Ray (CPU, gloo), through the production ServingBackend and the
OpenAI HTTP / gRPC frontends: router restart under load, KV transfers that fail or stall,
request deadlines, and a decode replica killed mid-stream. After each: the request was
retried or failed clearly (never hung), live block pools are back to baseline, and a dead
replica is out of routing. (Prefill killed mid-prefill: tests/workers/test_disagg.py.)"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
import ray

from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.proto import load_stubs
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import (
    HELD_S,
    cluster_config,
    grpc_stub,
    serving_backend,
    wait_for_baseline,
    wait_until,
)
from tests.helpers.deadlines import deadline_for, held_decode_steps, http_first_token_s

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
LEASE_S = 3.0
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# Three prompt families sharing 2-block prefixes, so the KV index has something to hold.
PREFIXES = [[(13 * i + 7 * f) % 400 + 20 for i in range(32)] for f in range(3)]
pb2, _ = load_stubs()


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    cfg = cluster_config(tiny_model, num_prefill=2, num_decode=2, policy="kv", lease_s=LEASE_S)
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


def complete(loop, cluster, prompt, params=GREEDY, timeout=60):
    return loop.run(cluster.complete(prompt, params), timeout=timeout)


def set_fault(cluster, **fault) -> None:
    ray.get([r.handle.inject_fault.remote(**fault) for r in cluster.prefill_pool.live_replicas()], timeout=10)


def iter_sse(lines):
    """The data payloads of SSE lines as they arrive: dicts, and the final "[DONE]"."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def sse_events(lines) -> list:
    return list(iter_sse(lines))


# ---- router restart ----------------------------------------------------------------------


def test_router_restart_under_load_rebuilds_the_index_from_snapshots(loop, cluster):
    old_router = cluster.router
    num_workers = 6
    finished: list[float] = []
    restarts: list[tuple[float, float]] = []

    async def worker(w: int, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set():
            prompt = PREFIXES[(w + i) % len(PREFIXES)] + [w + 1, i % 50 + 1]
            result = await cluster.complete(prompt, GREEDY)  # raises if the request failed
            assert len(result["token_ids"]) == GREEDY.max_tokens
            finished.append(time.monotonic())
            i += 1

    async def finished_after(since: float, what: str) -> None:
        """Until num_workers more requests finish after `since` (by events, not a clock: the
        restarts land under load on a quiet machine and on a busy one)."""

        async def count() -> None:
            while sum(t > since for t in finished) < num_workers:
                await asyncio.sleep(0.01)

        try:
            await asyncio.wait_for(count(), 60)
        except TimeoutError:
            raise AssertionError(f"requests stopped {what}") from None

    async def restarter(stop: asyncio.Event) -> None:
        try:
            await finished_after(0.0, "before the first restart")  # load is flowing
            for n in range(2):
                began = time.monotonic()
                await cluster.restart_router()
                restarts.append((began, time.monotonic()))
                await finished_after(restarts[-1][1], f"after restart {n + 1}")
        finally:
            stop.set()

    async def go():
        stop = asyncio.Event()
        await asyncio.gather(restarter(stop), *(worker(w, stop) for w in range(num_workers)))

    start = time.monotonic()
    loop.run(go(), timeout=180)
    print(
        f"router restart: {len(finished)} requests from {num_workers} clients in {time.monotonic() - start:.1f} s, "
        f"restarts took {', '.join(f'{(b - a) * 1000:.0f} ms' for a, b in restarts)}"
    )
    assert len(restarts) == 2 and cluster.router is not old_router
    assert cluster.dispatcher.router is cluster.router
    last_restart_end = restarts[-1][1]
    assert sum(t > last_restart_end for t in finished) >= num_workers, "requests stopped after the restart"
    assert sum(restarts[0][1] < t < restarts[1][0] for t in finished) >= 1, "nothing finished between restarts"

    # The rebuilt index is exactly what every replica holds (the poller keeps it current).
    def index_matches() -> bool:
        for pool in (PREFILL, DECODE):
            for replica in cluster.pools[pool].live_replicas():
                _, hashes = ray.get(replica.handle.snapshot.remote(), timeout=10)
                if cluster.router.index(pool).replica_hashes(replica.replica_id) != set(hashes):
                    return False
        return True

    wait_until(index_matches, None, "the rebuilt router's index differs from the replicas' snapshots")
    assert sorted(cluster.router.replica_ids(PREFILL)) == sorted(
        r.replica_id for r in cluster.prefill_pool.live_replicas()
    )
    assert sorted(cluster.router.replica_ids(DECODE)) == sorted(
        r.replica_id for r in cluster.decode_pool.live_replicas()
    )
    # ... and the router routes by it: a known prefix goes where it is cached.
    decision = cluster.router.route(PREFIXES[0] + [99, 98])
    assert decision.decode_cached_tokens >= 16 or decision.prefill_cached_tokens >= 16
    wait_for_baseline(loop, cluster)


# ---- KV transfer failures ----------------------------------------------------------------


def test_failed_kv_sends_are_retried_within_the_budget_or_fail_clearly(loop, cluster):
    prompt = PREFIXES[1] + list(range(300, 340))  # uncached tail: a real transfer
    reference = complete(loop, cluster, prompt)["token_ids"]
    wait_for_baseline(loop, cluster)
    prompt = PREFIXES[2] + list(range(300, 340))  # fresh blocks again
    retries = cluster.dispatcher.num_retries

    # Every prefill replica fails its next send: both attempts fail, the budget (1 retry) is spent.
    set_fault(cluster, fail_sends=1)
    with pytest.raises(RequestError, match="request failed: .*injected send failure") as failed:
        complete(loop, cluster, prompt)
    assert failed.value.kind is ErrorKind.INTERNAL
    assert cluster.dispatcher.num_retries == retries + 1
    wait_for_baseline(loop, cluster, timeout_s=LEASE_S)

    # A bigger budget: both prefill replicas fail, the decode replica then prefills itself.
    cluster.dispatcher.max_retries = 2
    try:
        set_fault(cluster, fail_sends=1)
        result = complete(loop, cluster, PREFIXES[2] + list(range(340, 380)))
        assert cluster.dispatcher.num_retries == retries + 3
        assert result["prefill_replica"] is None and len(result["token_ids"]) == GREEDY.max_tokens
    finally:
        cluster.dispatcher.max_retries = 1
    wait_for_baseline(loop, cluster, timeout_s=LEASE_S)
    # Faults spent: an ordinary transfer works again, and gives the same tokens as before.
    assert complete(loop, cluster, PREFIXES[1] + list(range(300, 340)))["token_ids"] == reference


def test_stalled_kv_send_frees_blocks_within_the_lease_and_is_retried(loop, cluster):
    stalled, *others = sorted(r.replica_id for r in cluster.prefill_pool.live_replicas())
    retries = cluster.dispatcher.num_retries
    # Stalled until the test switches it off: an answer at all means the retry did not wait for it.
    ray.get(cluster.prefill_pool.get(stalled).handle.inject_fault.remote(stall_send_s=HELD_S))
    for rid in others:  # route the first attempt to the stalled replica
        cluster.router.set_draining(PREFILL, rid, True)
    try:
        start = time.monotonic()
        result = complete(loop, cluster, PREFIXES[0] + list(range(200, 230)), timeout=60)
        took = time.monotonic() - start
    finally:
        for rid in others:
            cluster.router.set_draining(PREFILL, rid, False)
        ray.get(cluster.prefill_pool.get(stalled).handle.inject_fault.remote(stall_send_s=0.0))
    # The attempt stalled until decode gave the prefill up (its timeout follows the measured
    # prefill speed, at most the lease); the retry (no other prefill replica left to try)
    # prefilled on the decode replica.
    assert result["prefill_replica"] is None and len(result["token_ids"]) == GREEDY.max_tokens
    assert cluster.dispatcher.num_retries == retries + 1
    print(f"stalled send: lease {LEASE_S:.0f} s, request answered after retry in {took:.2f} s")
    # The stalled attempt's blocks were freed on both sides (switching the stall off woke its sender).
    wait_for_baseline(loop, cluster, timeout_s=LEASE_S)
    assert complete(loop, cluster, PREFIXES[0] + list(range(230, 260)))["prefill_replica"] is not None
    wait_for_baseline(loop, cluster)


# ---- deadlines ---------------------------------------------------------------------------
GATEWAY_TIMEOUT = 504  # HTTP's status for ErrorKind.DEADLINE
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}


def test_deadline_over_http_is_504_and_frees_blocks(loop, cluster, backend, server):
    body = {"model": backend.model_name, "prompt": PREFIXES[1], **LONG}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        deadline_s = deadline_for(http_first_token_s(http, body))
        timeout_header = {"x-request-timeout": str(deadline_s)}
        with held_decode_steps(cluster, deadline_s, LONG["max_tokens"]) as least_work_s:
            print(f"deadline {deadline_s:.2f} s; the held work takes at least {least_work_s:.1f} s")
            # The hold holds: a short request (no deadline) takes at least its held steps.
            few, step_s = 12, least_work_s / (LONG["max_tokens"] - 1)
            start = time.monotonic()
            short = http.post("/v1/completions", json={**body, "max_tokens": few})
            assert short.status_code == 200 and time.monotonic() - start >= (few - 1) * step_s
            start = time.monotonic()
            resp = http.post("/v1/completions", json=body, headers=timeout_header)
            assert resp.status_code == GATEWAY_TIMEOUT, resp.text
            assert time.monotonic() - start < least_work_s / 2  # cut at its deadline, not run out
            error = resp.json()["error"]
            assert error["type"] == "timeout_error" and "deadline" in error["message"]
            wait_for_baseline(loop, cluster)

            # Streaming: tokens already went out, so the deadline is an error event, then [DONE].
            with http.stream(
                "POST", "/v1/completions", json={**body, "stream": True}, headers=timeout_header
            ) as stream:
                assert stream.status_code == 200
                events = sse_events(stream.iter_lines())
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == GATEWAY_TIMEOUT
            assert any(e != "[DONE]" and "choices" in e for e in events)
            wait_for_baseline(loop, cluster)

            # The server's own limit (request_timeout_s) applies without a header.
            cfg = backend.cfg
            backend.cfg = cfg.model_copy(update={"request_timeout_s": deadline_s})
            try:
                assert http.post("/v1/completions", json=body).status_code == GATEWAY_TIMEOUT
            finally:
                backend.cfg = cfg
        for bad in ("0", "-1", "soon", "nan", "inf"):
            resp = http.post("/v1/completions", json=body, headers={"x-request-timeout": bad})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-request-timeout"
        ok = http.post("/v1/completions", json={**body, "max_tokens": 4}, headers={"x-request-timeout": "60"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    wait_for_baseline(loop, cluster)


def test_grpc_deadline_cancels_the_request_and_frees_blocks(loop, cluster, backend):
    with grpc_stub(loop, backend) as stub:
        request = pb2.GenerateRequest(
            token_ids=pb2.TokenIds(ids=PREFIXES[2]), max_tokens=2, temperature=0, ignore_eos=True
        )
        first_token_s = []
        for _ in range(3):
            start = time.monotonic()
            responses = stub.Generate(request, timeout=60)
            first = next(responses)
            first_token_s.append(time.monotonic() - start)
            assert [first, *responses][-1].finished
        deadline_s = deadline_for(first_token_s)
        request.max_tokens = LONG["max_tokens"]
        with held_decode_steps(cluster, deadline_s, LONG["max_tokens"]):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=deadline_s))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_for_baseline(loop, cluster)
        request.max_tokens = 3
        assert list(stub.Generate(request, timeout=30))[-1].usage.completion_tokens == 3
    wait_for_baseline(loop, cluster)


def test_deadline_during_a_stalled_transfer_fails_without_retry(loop, cluster):
    retries = cluster.dispatcher.num_retries
    set_fault(cluster, stall_send_s=HELD_S)  # the transfer cannot finish before the deadline
    try:

        async def go():
            stream = cluster.generate(PREFIXES[2] + list(range(100, 120)), GREEDY, deadline=time.time() + 1.0)
            return [chunk async for chunk in stream]

        with pytest.raises(RequestError) as exc:
            loop.run(go(), timeout=30)
        assert exc.value.kind is ErrorKind.DEADLINE
        assert cluster.dispatcher.num_retries == retries  # no retry past the deadline
    finally:
        set_fault(cluster, stall_send_s=0.0)
    wait_for_baseline(loop, cluster, timeout_s=2 * LEASE_S)


# ---- a decode replica dies mid-stream (last: it leaves one decode replica) ----------------


def test_decode_killed_mid_stream_ends_the_sse_stream_with_an_error(loop, cluster, backend, server, caplog):
    assert len(cluster.decode_pool.live_replicas()) == 2
    # Opted out of migration: the stream fails with its replica, as every stream did before.
    body = {"model": backend.model_name, "prompt": PREFIXES[0], "stream": True, "migration": False, **LONG}
    label = "killed-mid-stream"  # the client's id: the dispatcher names it when it retries
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body, headers={"x-request-id": label}) as stream:
            assert stream.status_code == 200
            events = iter_sse(stream.iter_lines())
            next(events)  # a token reached the client
            (victim_id,) = cluster.dispatcher.inflight.values()  # the one request in flight
            victim = cluster.decode_pool.get(victim_id)
            killed_at, killed_wall = time.monotonic(), time.time()
            ray.kill(victim.handle)
            rest = list(events)
            ended = time.monotonic() - killed_at
        print(f"decode killed mid-stream: error event + [DONE] {ended:.2f} s after the kill")
        assert rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        # 503 for the death (a stream left hanging would end at a deadline: 504), however long it took.
        assert error["code"] == 503 and error["type"] == "server_error" and "request failed" in error["message"]
        retried = [
            r.getMessage()
            for r in caplog.records
            if "retrying" in r.getMessage() and repr(label) in r.getMessage() and r.created >= killed_wall
        ]
        assert not retried, retried  # tokens were out: never retried (a slow prefill before them may be)
        wait_until(
            lambda: victim.replica_id not in cluster.router.replica_ids(DECODE),
            None,
            "the dead decode replica is still routed",
        )
        wait_until(
            lambda: cluster.decode_pool.get(victim.replica_id) is None,
            None,
            "the controller still lists the dead replica",
        )
        ok = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    wait_for_baseline(loop, cluster)
