"""Hand-written abuse over HTTP against the real app over a real tiny 1P+1D cluster (the
package's conftest): oversized and chunked bodies, huge max_tokens, invalid UTF-8, lone
surrogates, deep JSON, thousands of stop strings, API keys and per-key limits. After each bad
request a normal one still succeeds; the block pools end at baseline."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from tests.helpers.cluster import wait_for_baseline, wait_until
from tests.helpers.hostile_cases import raw_completion_cases
from tests.helpers.hostile_server import (
    API_KEY,
    AUTH,
    MAX_BODY_BYTES,
    assert_openai_error,
    normal_request_works,
    ray_get,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


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
        wait_until(lambda: backend.num_inflight == 2, None, "the two requests were not admitted")
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
