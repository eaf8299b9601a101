"""One real tiny 1P+1D cluster (local Ray, CPU) behind the real HTTP app and gRPC frontend,
shared by every hostile-input test module in this package (test_hostile_fuzz.py,
test_hostile_http.py, test_hostile_grpc.py): package scope, so splitting the tests into files
starts no second cluster.

Why this shape: generation is real but cheap. The tiny model, 4 KV blocks per replica (so
prompt + max_tokens <= 64 tokens; larger asks are a 400) and uvicorn on the cluster's own
event loop keep a case at tens of milliseconds."""

from __future__ import annotations

import httpx
import pytest

from splitserve.cluster.frontend.http.api import build_http_app
from tests.helpers.cluster import LoopHttpServer, LoopThread, cluster_config, grpc_frontend_port, serving_backend
from tests.helpers.hostile_server import API_KEY, AUTH, MAX_BODY_BYTES


@pytest.fixture(scope="package")
def loop():
    """The cluster's event loop for the whole package (the suite's `loop` is per module)."""
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def server(loop, backend):
    with LoopHttpServer(loop, build_http_app(backend)) as srv:
        yield srv


@pytest.fixture(scope="package")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


@pytest.fixture(scope="package")
def grpc_port(loop, backend):
    with grpc_frontend_port(loop, backend) as port:
        yield port
