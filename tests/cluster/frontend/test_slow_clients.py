"""Slow and idle clients against the real HTTP app on a real uvicorn (fake backend): a
connection that sends half a request (headers, or a body) or nothing at all is closed within
http_request_timeout_s; a stream that outlives that timeout many times over is not cut."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.http.header_timeout import with_timeout
from tests.helpers.http_api import MODEL_NAME, FakeBackend, ServerThread

TIMEOUT_S = 1.0
SAFETY_S = 30.0  # how long a test waits for the close at most; the close is expected near TIMEOUT_S


@pytest.fixture
def server(tokenizer):
    backend = FakeBackend(tokenizer, ServeConfig(http_request_timeout_s=TIMEOUT_S))
    with ServerThread(build_http_app(backend), http=with_timeout(TIMEOUT_S)) as srv:
        yield srv, backend


def closed_within(sock: socket.socket) -> tuple[float, bytes]:
    """Seconds until the server closes sock (reading whatever it sends first), and what it sent."""
    started = time.monotonic()
    sock.settimeout(SAFETY_S)
    received = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return time.monotonic() - started, received
        received += chunk


HALF_REQUESTS = {
    "nothing at all": b"",
    "half a request line": b"POST /v1/compl",
    "headers without their end": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
    "half a Content-Length body": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 200\r\n\r\n{"model": "tiny-test", "pro'
    ),
    "half a chunked body": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Transfer-Encoding: chunked\r\n\r\n10\r\n{"model": "tiny-'
    ),
}


@pytest.mark.parametrize("name", list(HALF_REQUESTS))
def test_a_half_sent_request_is_closed_within_the_timeout(server, name):
    srv, _ = server
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=SAFETY_S) as sock:
        sock.sendall(HALF_REQUESTS[name])
        elapsed, reply = closed_within(sock)
    assert elapsed < SAFETY_S
    assert elapsed >= TIMEOUT_S * 0.9, elapsed  # the timeout, not some other error, closed it
    if b"body" in name.encode():
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]  # the body guard answers first
    # The server still serves.
    resp = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_a_stream_outliving_the_timeout_many_times_is_not_cut(server):
    srv, backend = server
    backend.token_interval_s = TIMEOUT_S / 10  # a steady trickle: the stream is never idle
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    outlive = 3 * TIMEOUT_S
    events = 0
    started = time.monotonic()
    with httpx.Client(timeout=SAFETY_S) as client:
        with client.stream("POST", f"{srv.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                assert payload != "[DONE]", "the stream ended before it outlived the timeout"
                assert json.loads(payload)["choices"][0]["finish_reason"] is None
                events += 1
                if time.monotonic() - started > outlive:
                    break  # tokens still arriving 3 timeouts in: not cut
    assert time.monotonic() - started > outlive and events > 3
    # A kept-alive connection that goes idle is the keep-alive timeout's, not this one's;
    # a new request on a fresh connection works.
    resp = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200
