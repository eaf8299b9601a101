"""Priority classes at the front doors (fake backends): the header / gRPC field names the class,
`priority` overrides its default, batch is sheddable, an unknown class is a 400 /
INVALID_ARGUMENT, and policy fcfs makes every request equal. The router names the replicas
without headroom for batch work, and routes batch work only to replicas with headroom."""

from __future__ import annotations

import grpc
import pytest
from fastapi.testclient import TestClient

from splitserve.cluster.config import PriorityConfig, ServeConfig
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.priority_class import PRIORITY_CLASS_HEADER, resolve_priority
from splitserve.cluster.routing.batch_headroom import BatchHeadroom
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.cluster.routing.router import NoHeadroomError, Router
from tests.helpers.http_api import MODEL_NAME, FakeBackend


def test_resolve_priority_defaults_overrides_and_fcfs():
    cfg = PriorityConfig(interactive=1, batch=50)
    assert resolve_priority(cfg, None, None) == resolve_priority(cfg, "interactive", None)
    assert (resolve_priority(cfg, None, None).priority, resolve_priority(cfg, None, None).sheddable) == (1, False)
    assert (resolve_priority(cfg, "Batch", None).priority, resolve_priority(cfg, "batch", 7).priority) == (50, 7)
    assert resolve_priority(cfg, "batch", None).sheddable
    fcfs = PriorityConfig(policy="fcfs")
    assert (resolve_priority(fcfs, "batch", 9).priority, resolve_priority(fcfs, "batch", 9).sheddable) == (0, False)
    with pytest.raises(ValueError, match="priority.batch must be >= priority.interactive"):
        PriorityConfig(interactive=5, batch=1)


@pytest.fixture
def http(tokenizer):
    backend = FakeBackend(tokenizer, ServeConfig(priority={"interactive": 2, "batch": 40}))
    with TestClient(build_http_app(backend), raise_server_exceptions=False) as client:
        yield client, backend


def test_http_class_header_and_priority_field(http):
    client, backend = http
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json=body, headers={PRIORITY_CLASS_HEADER: "batch"}).status_code == 200
    assert client.post("/v1/completions", json={**body, "priority": -3}).status_code == 200
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 9}
    assert client.post("/v1/chat/completions", json=chat, headers={PRIORITY_CLASS_HEADER: "batch"}).status_code == 200
    seen = [(c["params"].priority, c["sheddable"]) for c in backend.calls]
    assert seen == [(2, False), (40, True), (-3, False), (9, True)]


@pytest.mark.parametrize(
    "headers, extra, message",
    [
        ({PRIORITY_CLASS_HEADER: "urgent"}, {}, "priority class must be one of interactive, batch"),
        ({}, {"priority": 2**40}, "priority must be a 32-bit integer"),
    ],
)
def test_http_bad_priority_is_a_400_and_runs_nothing(http, headers, extra, message):
    client, backend = http
    res = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", **extra}, headers=headers)
    assert res.status_code == 400 and message in res.json()["error"]["message"]
    assert backend.calls == []


def test_grpc_priority_fields(tokenizer):
    from splitserve.proto import load_stubs
    from tests.helpers.grpc_client import FakeBackend as GrpcFakeBackend
    from tests.helpers.grpc_client import serving_frontend

    pb2, pb2_grpc = load_stubs()
    backend = GrpcFakeBackend(tokenizer, ServeConfig(priority={"batch": 30}))
    with serving_frontend(backend) as (_, channel):
        stub = pb2_grpc.SplitServeStub(channel)

        def generate(**fields):
            request = pb2.GenerateRequest(model=backend.model_name, text="x", max_tokens=1, **fields)
            return list(stub.Generate(request, timeout=10))

        generate()
        generate(priority_class="batch")
        generate(priority=-1)
        with pytest.raises(grpc.RpcError) as refused:
            generate(priority_class="later")
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert [c[1].priority for c in backend.calls] == [0, 30, -1]
    assert backend.sheddable == [False, True, False]


def test_router_names_replicas_without_headroom():
    router = Router(block_size=16)
    for rid in ("d0", "d1", "d2"):
        router.add_replica(DECODE, rid)
    router.update_load(DECODE, "d0", LoadReport(num_running=1, kv_usage=0.2))
    router.update_load(DECODE, "d1", LoadReport(num_running=1, kv_usage=0.9))
    router.update_load(DECODE, "d2", LoadReport(num_running=8, kv_usage=0.1))
    assert router.replicas_without_headroom(DECODE, max_kv_usage=0.7, max_running=4) == {"d1", "d2"}
    router.load(DECODE, "d0").add_pending(0)  # routed since its report: counts as running
    assert router.replicas_without_headroom(DECODE, max_kv_usage=0.7, max_running=2) == {"d0", "d1", "d2"}


def test_the_router_sends_batch_work_only_where_there_is_headroom():
    router = Router(block_size=16, batch_headroom=BatchHeadroom(max_kv_usage=0.7, max_running=4))
    for rid in ("d0", "d1", "d2"):
        router.add_replica(DECODE, rid)
    router.update_load(DECODE, "d0", LoadReport(num_running=1, kv_usage=0.2))
    router.update_load(DECODE, "d1", LoadReport(num_running=1, kv_usage=0.9))
    router.update_load(DECODE, "d2", LoadReport(num_running=8, kv_usage=0.1))
    prompt = list(range(40))
    for _ in range(3):  # each pick adds to d0's running count: 1 + 3 stays below 4
        decision = router.route(prompt, sheddable=True)
        assert decision.decode_replica == "d0"
    with pytest.raises(NoHeadroomError, match="headroom for batch work"):
        router.route(prompt, sheddable=True)  # d0 now runs 4 (its report's 1 + 3 routed since)
    assert router.route(prompt).decode_replica in ("d0", "d1", "d2")  # interactive work goes anywhere
