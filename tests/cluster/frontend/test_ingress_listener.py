"""IngressListener (cluster/frontend/http/ingress_listener.py): the ingress replica's own uvicorn
serving the real HTTP app (fake backend) over a real socket, on an event loop of its own as
in a replica: a taken port fails bind() (the replica's start), nothing is answered before
serve(), a stream and the client's x-request-id come back whole, and stop() lets a stream in
flight finish before the port closes. resolve_http_listener's choice of the default."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest

from splitserve.cluster.cli.front_door import FrontDoor, resolve_http_listener
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.http.ingress_listener import IngressListener
from tests.helpers.http_api import MODEL_NAME, FakeBackend, parse_sse

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def run(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)


def test_a_taken_port_fails_bind():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listener = IngressListener("127.0.0.1", taken.getsockname()[1], keep_alive_timeout_s=5)
        with pytest.raises(OSError):
            listener.bind()


def test_serves_the_http_app_from_serve_until_stop(loop, tokenizer):
    backend = FakeBackend(tokenizer, ServeConfig())
    app = build_http_app(backend, echo_request_id=True)
    listener = IngressListener("127.0.0.1", 0, keep_alive_timeout_s=5)
    listener.bind()
    url = f"http://127.0.0.1:{listener.port}"
    with pytest.raises(httpx.HTTPError):  # bound, not yet listening: the app's start comes first
        httpx.get(f"{url}/health", timeout=2)
    run(loop, listener.serve(app))
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/health").status_code == 200
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "stream": True}
            resp = client.post("/v1/completions", json=body, headers={"x-request-id": "mine-1"})
            assert resp.status_code == 200 and resp.headers["x-request-id"] == "mine-1"
            events = parse_sse(resp.text)
            assert events[-1] == "[DONE]"
            text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
            assert text == backend.expected_text(4)
            # A stream open when stop() begins still ends whole.
            with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 6}) as streaming:
                stopping = asyncio.run_coroutine_threadsafe(listener.stop(grace_s=30), loop)
                rest = "".join(streaming.iter_text())
            assert rest.rstrip().endswith("data: [DONE]")
            stopping.result(timeout=30)
    finally:
        run(loop, listener.stop(grace_s=1))
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def test_one_fixed_ingress_replica_on_a_local_cluster_listens_itself():
    single = ServeConfig()
    assert resolve_http_listener(single, local=True) == "ingress"
    assert resolve_http_listener(single, local=False) == "haproxy"  # a joined cluster: any node
    two = ServeConfig.model_validate({"ingress": {"replicas": 2}})
    assert resolve_http_listener(two, local=True) == "haproxy"
    scaled = ServeConfig.model_validate({"ingress": {"autoscaling": {"enabled": True}}})
    assert resolve_http_listener(scaled, local=True) == "haproxy"
    chosen = ServeConfig(http_listener="haproxy")
    assert resolve_http_listener(chosen, local=True) == "haproxy"
    with pytest.raises(ValueError, match="one ingress replica"):
        ServeConfig.model_validate({"http_listener": "ingress", "ingress": {"replicas": 2}})


def test_the_replica_listener_runs_serve_with_no_proxy_nor_haproxy():
    door = FrontDoor(local=True, listener="ingress")
    env = door.environment(ServeConfig())
    assert door.proxy_location == "Disabled" and door.state_dir is None
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in env and env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"  # else Serve's controller starts a proxy on the port
    behind = FrontDoor(local=True)
    try:
        assert behind.environment(ServeConfig())["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        assert behind.proxy_location is None
    finally:
        behind.cleanup()
