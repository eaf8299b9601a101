"""Hostile input against the real frontends over a real tiny 1P+1D cluster (local Ray, CPU):
schemathesis-generated requests from /openapi.json (no 5xx, no crash), hand-written abuse
(oversized and chunked bodies, huge max_tokens, invalid UTF-8, lone surrogates, deep JSON,
thousands of stop strings), malformed gRPC messages, API keys and per-key limits. After each
bad request a normal one still succeeds; at the end the block pools are back to baseline.

Why this shape: generation is real but cheap. The tiny model, 4 KV blocks per replica (so
prompt + max_tokens <= 64 tokens; larger asks are a 400) and uvicorn on the cluster's own
event loop keep a case at tens of milliseconds; schemathesis drives the operations through
Hypothesis directly (fixed seed, no example database) so the case count is exact."""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import threading
import time

import grpc
import httpx
import hypothesis
import pytest
import ray
import requests
import schemathesis
from hypothesis import HealthCheck, Phase

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.grpc.server import GrpcFrontend
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.proto import load_stubs
from splitserve.proto.messages.request_channel import ChannelError, Submit, decode_to_decode, encode_frame
from tests.helpers.cluster import LoopHttpServer, cluster_config, serving_backend, wait_for_baseline, wait_until
from tests.helpers.hostile_cases import (
    HOSTILE_GRPC,
    HOSTILE_HTTP,
    MALFORMED_GRPC,
    POSITIVE_REFUSALS,
    raw_completion_cases,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
API_KEY = "sk-hostile-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 256 * 1024  # room for the 10,000-rule GBNF chain (~150 KB)
# Cases per (operation, generation mode): chat bodies cost 3x more to generate than
# completion bodies; operations without parameters stop after one.
FUZZ_EXAMPLES = {
    ("POST", "/v1/completions"): {"positive": 330, "negative": 260},
    ("POST", "/v1/chat/completions"): {"positive": 150, "negative": 120},
    ("GET", "/v1/models/{model_id}"): {"positive": 60, "negative": 60},
}
MIN_FUZZ_CASES = 1000
FUZZ_SEED = int(os.environ.get("SPLITSERVE_FUZZ_SEED", "20240611"))
pb2, pb2_grpc = load_stubs()


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    cfg = cluster_config(
        tiny_model,
        policy="kv",
        num_blocks=4,
        api_key=API_KEY,
        max_body_bytes=MAX_BODY_BYTES,
        max_requests_per_key=2,
        max_queued_requests=16,
    )
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def server(loop, backend):
    with LoopHttpServer(loop, build_http_app(backend)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_port(loop, backend):
    frontend = GrpcFrontend(backend)
    port = loop.run(frontend.start("127.0.0.1", 0))
    yield port
    loop.run(frontend.stop(1.0))


def normal_request_works(http, model: str) -> None:
    # ignore_eos: a random model may sample its EOS early; the check is that the server still serves.
    resp = http.post(
        "/v1/completions",
        json={"model": model, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


def assert_openai_error(resp, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] and "Traceback" not in error["message"]
    for word in words:
        assert word.lower() in error["message"].lower(), error["message"]
    return error


# ---- schemathesis ------------------------------------------------------------------------


def test_generated_requests_never_get_a_5xx(loop, backend, server, http):
    schema = schemathesis.openapi.from_dict(build_http_app(backend).openapi())
    session = requests.Session()
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}

    def check(case) -> None:
        case.headers = {**(case.headers or {}), **AUTH}  # reach past the key check (tested below)
        resp = case.call(base_url=server.url, session=session, timeout=60)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        where = f"{case.method} {case.path} body={str(case.body)[:300]!r}"
        assert resp.status_code < 500, f"{where} -> {resp.status_code} {resp.text[:300]}"
        content_type = resp.headers.get("content-type") or [""]  # schemathesis: name -> values
        if content_type[0].startswith("text/event-stream"):
            # schemathesis stops reading a stream after 20 events (prompts x n choices make more)
            if not resp.stream_cut_short:
                assert resp.text.rstrip().endswith("data: [DONE]"), where
            assert '"server_error"' not in resp.text, f"{where} -> {resp.text[-300:]}"
        return resp

    def check_positive(case) -> None:
        # A request /openapi.json calls valid is served, unless its refusal depends on state
        # or on what JSON Schema cannot state (see POSITIVE_REFUSALS).
        resp = check(case)
        if resp.status_code == 400:  # a 404 for a model id that is not served is no refusal
            message = resp.json()["error"]["message"]
            assert any(reason in message for reason in POSITIVE_REFUSALS), (
                f"schema-valid {case.method} {case.path} body={str(case.body)[:300]!r} -> {resp.status_code} {message}"
            )

    for result in schema.get_all_operations():
        operation = result.ok()
        key = (operation.method.upper(), operation.path)
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            num = FUZZ_EXAMPLES.get(key, {}).get(mode.value, 20)
            checker = check_positive if mode == schemathesis.GenerationMode.POSITIVE else check
            counts[f"{key[0]} {key[1]} {mode.value}"] = fuzz_operation(operation, mode, num, checker)
    total = sum(counts.values())
    print(f"schemathesis: {total} cases, by operation {counts}, by status {dict(sorted(statuses.items()))}")
    assert total >= MIN_FUZZ_CASES, counts
    assert statuses.get(200, 0) >= 100, statuses  # real generations ran, not only refusals
    normal_request_works(http, backend.model_name)
    wait_for_baseline(loop, backend.cluster)


def fuzz_operation(operation, mode, max_examples: int, check) -> int:
    """Run `check` on up to max_examples schemathesis cases of one operation; returns how many."""
    num_cases = 0

    @hypothesis.seed(FUZZ_SEED)
    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        print_blob=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        nonlocal num_cases
        num_cases += 1
        check(case)

    try:
        fuzz()
    except hypothesis.errors.Unsatisfiable:  # no invalid input exists (an operation without parameters)
        assert mode == schemathesis.GenerationMode.NEGATIVE
    return num_cases


# ---- hand-written abuse over HTTP ----------------------------------------------------------


@pytest.mark.parametrize("case", range(len(raw_completion_cases("m"))), ids=[c[0] for c in raw_completion_cases("m")])
def test_hostile_bodies_get_a_clear_4xx_and_the_server_keeps_serving(http, backend, case):
    name, body, status, word = raw_completion_cases(backend.model_name)[case]
    resp = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    if status == 200:
        assert resp.status_code == 200, resp.text
    else:
        assert_openai_error(resp, status, word)
    normal_request_works(http, backend.model_name)


def test_hostile_chat_messages(http, backend):
    model = backend.model_name
    cases = [
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "Unicode"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "Unicode"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 1000}, "at most 64"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": None}, "KV cache"),  # rest of the context
    ]
    for extra, word in cases:
        # json.dumps escapes lone surrogates as \\udXXX, exactly what a hostile client sends.
        body = json.dumps({"model": model, "max_tokens": 2, **extra}).encode()
        resp = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert_openai_error(resp, 400, word)
    ok = http.post(
        "/v1/chat/completions",
        json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_oversized_bodies_are_413_declared_or_chunked(server, http, backend):
    big = json.dumps({"model": backend.model_name, "prompt": "x" * (2 * MAX_BODY_BYTES)}).encode()
    assert_openai_error(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413, "exceeds"
    )

    def chunks():  # no Content-Length: the guard counts the bytes as they arrive
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    resp = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(resp, 413, "exceeds")
    # A client that claims a huge body and then sends nothing is refused before any read.
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n"
        )
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    normal_request_works(http, backend.model_name)


def test_api_key_and_per_key_concurrency_limit(loop, server, http, backend):
    model = backend.model_name
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 2}
    assert_openai_error(httpx.post(f"{server.url}/v1/completions", json=body, timeout=10), 401)
    assert_openai_error(
        httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10), 401
    )
    # max_requests_per_key = 2: while two requests of a key are in flight (held in their KV
    # transfer by a stalled sender), a third on the same key is refused with 429.
    prefill = backend.cluster.prefill_pool.live_replicas()[0].handle
    statuses: list[int] = []

    def one() -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
            statuses.append(client.post("/v1/completions", json=body).status_code)

    ray_get(prefill.inject_fault.remote(stall_send_s=0.8))
    try:
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: backend.num_inflight == 2, 20, "the two requests were not admitted")
        refused = http.post("/v1/completions", json=body)
        for t in threads:
            t.join(60)
    finally:
        ray_get(prefill.inject_fault.remote(stall_send_s=0.0))
    assert statuses == [200, 200]
    error = assert_openai_error(refused, 429, "API key")
    assert error["type"] == "rate_limit_error" and refused.headers["retry-after"]
    normal_request_works(http, model)
    wait_for_baseline(loop, backend.cluster)


def ray_get(ref):
    return ray.get(ref, timeout=30)


# ---- gRPC --------------------------------------------------------------------------------


def test_malformed_grpc_messages_are_invalid_argument(grpc_port, backend):
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb2_grpc.SplitServeStub(channel)
        for method, garbage in MALFORMED_GRPC:
            path = f"/splitserve.v1.SplitServe/{method}"
            if method == "Generate":
                call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
                with pytest.raises(grpc.RpcError) as err:
                    list(call(garbage, metadata=metadata, timeout=10))
            else:
                call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
                with pytest.raises(grpc.RpcError) as err:
                    call(garbage, metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, garbage, err.value.details())
            assert "malformed" in err.value.details()
            ok = list(
                stub.Generate(pb2.GenerateRequest(text="Once upon a time", max_tokens=2), metadata=metadata, timeout=30)
            )
            assert ok[-1].finished and ok[-1].usage.completion_tokens == 2
        bad_values = [
            (pb2.GenerateRequest(text="x", max_tokens=2**32 - 1), grpc.StatusCode.INVALID_ARGUMENT),
            (pb2.GenerateRequest(text="x", stop=["s"] * 5000), grpc.StatusCode.INVALID_ARGUMENT),
            (pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[4_000_000_000])), grpc.StatusCode.INVALID_ARGUMENT),
            (pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
            (pb2.GenerateRequest(text="x" * (2 * MAX_BODY_BYTES)), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ]
        for request, code in bad_values:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=metadata, timeout=30))
            assert err.value.code() == code, (err.value.code(), err.value.details())
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb2.GenerateRequest(text="x", max_tokens=2), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = list(
            stub.Generate(pb2.GenerateRequest(text="Once upon a time", max_tokens=2), metadata=metadata, timeout=30)
        )
        assert ok[-1].usage.completion_tokens == 2


# ---- security defaults ---------------------------------------------------------------------


def test_secure_defaults_and_no_pickle_from_clients():
    cfg = ServeConfig()
    assert (cfg.http_host, cfg.grpc_host, cfg.transport_host) == ("127.0.0.1",) * 3
    assert cfg.max_body_bytes <= 1 << 20 and cfg.max_requests_per_key >= 1 and cfg.api_key is None
    # What a replica accepts from the frontend is typed msgpack; a pickle is refused unread.
    request = Submit(request_id="r", prompt_token_ids=[1, 2], sampling={})
    assert decode_to_decode(encode_frame(request)[4:]) == request
    with pytest.raises(ChannelError):
        decode_to_decode(pickle.dumps(request))
    started = time.monotonic()
    with pytest.raises(ChannelError):
        decode_to_decode(b"\xdd\xff\xff\xff\xff")  # msgpack array header claiming 4G items
    assert time.monotonic() - started < 1


# ---- hostile constraints: refused up front, the ingress and its streams unharmed -----------

SAFETY_S = 30.0  # a refusal is expected in milliseconds; this only keeps a hang from hanging the suite
STREAM_TOKENS = 30


def stream_completion(server, model: str, out: list) -> None:
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            out.append((resp.status_code, [line for line in resp.iter_lines() if line.startswith("data: ")]))


def test_hostile_constraints_are_refused_and_concurrent_streams_finish_whole(loop, server, http, grpc_port, backend):
    pid, model = os.getpid(), backend.model_name
    prefill = backend.cluster.prefill_pool.live_replicas()[0].handle
    streams: list = []
    ray_get(prefill.inject_fault.remote(stall_send_s=0.8))  # keeps both streams in flight meanwhile
    threads = [threading.Thread(target=stream_completion, args=(server, model, streams)) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: backend.num_inflight == 2, 20, "the two streams were not admitted")
        for path, extra, field, word in HOSTILE_HTTP:
            body = {"model": model, "max_tokens": 2, **extra}
            if path.endswith("chat/completions"):
                body["messages"] = [{"role": "user", "content": "hi"}]
            else:
                body["prompt"] = "x"
            started = time.monotonic()
            resp = http.post(path, json=body, timeout=SAFETY_S)
            error = assert_openai_error(resp, 400, field, word)
            assert error["param"] == field.split("[")[0] or error["param"] == field, error
            assert time.monotonic() - started < SAFETY_S
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb2_grpc.SplitServeStub(channel)
            for request, field, word in HOSTILE_GRPC:
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(request, metadata=metadata, timeout=SAFETY_S))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                assert field in err.value.details() and word in err.value.details(), err.value.details()
            # Two members of the structured_output oneof on the wire: protobuf would keep the
            # last silently (json_object); refused, as HTTP refuses two constraints.
            both = (
                pb2.GenerateRequest(text="x", regex="a+").SerializeToString()
                + pb2.GenerateRequest(json_object=True).SerializeToString()
            )
            call = channel.unary_stream("/splitserve.v1.SplitServe/Generate", None, None)
            with pytest.raises(grpc.RpcError) as err:
                list(call(both, metadata=metadata, timeout=SAFETY_S))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "json_object and regex" in err.value.details(), err.value.details()
    finally:
        ray_get(prefill.inject_fault.remote(stall_send_s=0.0))
        for t in threads:
            t.join(120)
    assert os.getpid() == pid  # this process is the ingress: it served every request above
    assert len(streams) == 2
    for status, events in streams:
        assert status == 200 and events[-1] == "data: [DONE]", events[-3:]
        usage = json.loads(events[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == STREAM_TOKENS, usage
    assert backend.grammar.stats()["worker_losses"] == 0  # the bounds stopped them before any compile
    metrics = loop.run(backend.render_metrics()).decode()
    assert re.search(r"splitserve_grammar_check_refused_total\{[^}]*\} [1-9]", metrics), metrics[-2000:]
    assert "splitserve_grammar_verdict_cache_entries{" in metrics
    normal_request_works(http, model)
    wait_for_baseline(loop, backend.cluster)
