"""The two frontends are one pipeline: the same request over HTTP (/v1/completions, token ids
as the prompt) and over gRPC (Generate, token_ids) produces the same tokens, is refused with
the same error, and reserves the same tenant budget. One table of requests walks both adapters
over one ModelService: the real HTTP app (uvicorn) and GrpcFrontend on one loop, a real
TenantGate on a SQLite store, the scripted FakeBackend below them."""

from __future__ import annotations

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.grpc.server import GrpcFrontend
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.priority_class import PRIORITY_CLASS_HEADER
from splitserve.cluster.state.database import open_state_engine
from splitserve.cluster.tenants.tenant_gate import TenantGate
from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
from splitserve.proto import load_stubs
from tests.helpers.cluster import LoopHttpServer, LoopThread
from tests.helpers.http_api import MODEL_NAME, FakeBackend, tiny_tokenizer

pb2, pb2_grpc = load_stubs()
pytestmark = [pytest.mark.timeout(120)]
KEY, BUDGET_KEY = "sk-open", "sk-budget"  # BUDGET_KEY: the frontend's own budget tenant (-http, -grpc)
PROMPT = [5, 6, 7, 8]
RESERVED = len(PROMPT) + 16  # a request of the default max_tokens reserves prompt + 16
# Each request settles to its prompt + the scripted reply (4 + 13 tokens): 3 requests (spent
# 0, 17, 34 when admitted) fit under 60 with a reservation of 20 each, the 4th (51 + 20) does not.
BUDGET = 60
# name -> (request fields, the key); the fields are spelled once and sent both ways.
CASES = {
    "plain": ({"max_tokens": 5}, KEY),
    "default max_tokens": ({}, KEY),
    "ignore_eos": ({"max_tokens": 20, "ignore_eos": True}, KEY),
    "seeded sampling": ({"max_tokens": 6, "temperature": 0.8, "seed": 7}, KEY),
    "max_tokens past the model": ({"max_tokens": 5000}, KEY),
    "token id past the vocabulary": ({"prompt": [10**6]}, KEY),
    "bad priority class": ({"priority_class": "urgent"}, KEY),
    "unknown model": ({"model": "no-such-model"}, KEY),
    "unknown key": ({}, "sk-nobody"),
    **{f"budget {i}": ({}, BUDGET_KEY) for i in range(4)},  # the fourth is over the budget
}
HTTP_STATUS_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}


@pytest.fixture(scope="module")
def frontends(tmp_path_factory):
    tenants = [
        {"name": "open", "api_keys": [KEY]},
        *(
            {"name": f"budget-{via}", "api_keys": [f"{BUDGET_KEY}-{via}"], "budget_tokens": BUDGET}
            for via in ("http", "grpc")
        ),
    ]
    cfg = ServeConfig(tenants=tenants, state_dir=str(tmp_path_factory.mktemp("state")))
    backend = FakeBackend(tiny_tokenizer(tmp_path_factory.mktemp("tok")), cfg, max_model_len=256)
    engine = open_state_engine(f"sqlite:///{tmp_path_factory.mktemp('db') / 'state.db'}")
    backend.tenants = TenantGate(cfg, engine, "ingress-a", TenantMetrics(CollectorRegistry()))
    reserved: list[float] = []
    admit = backend.tenants.limiter.admit

    async def recording_admit(tenant, tokens):
        reserved.append(tokens)
        return await admit(tenant, tokens)

    backend.tenants.limiter.admit = recording_admit
    loop = LoopThread()
    grpc_frontend = GrpcFrontend(backend)
    port = loop.run(grpc_frontend.start("127.0.0.1", 0))
    with LoopHttpServer(loop, build_http_app(backend)) as server, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield server.url, pb2_grpc.SplitServeStub(channel), reserved
    loop.run(grpc_frontend.stop(1.0))
    loop.run(backend.tenants.close())
    engine.dispose()
    loop.stop()


def over_http(url: str, fields: dict, key: str) -> tuple[int, object]:
    body = {"model": MODEL_NAME, "prompt": PROMPT, **{k: v for k, v in fields.items() if k != "priority_class"}}
    headers = {"Authorization": f"Bearer {key}-http" if key == BUDGET_KEY else f"Bearer {key}"}
    if "priority_class" in fields:
        headers[PRIORITY_CLASS_HEADER] = fields["priority_class"]
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    if reply.status_code != 200:
        return reply.status_code, reply.json()["error"]["message"]
    return 200, reply.json()["choices"][0]["text"]


def over_grpc(stub, fields: dict, key: str) -> tuple[int, object]:
    prompt = fields.get("prompt", PROMPT)
    request = pb2.GenerateRequest(
        model=fields.get("model", ""),
        token_ids=pb2.TokenIds(ids=prompt),
        **{k: v for k, v in fields.items() if k not in ("prompt", "model")},
    )
    key = f"{key}-grpc" if key == BUDGET_KEY else key
    try:
        replies = list(stub.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {key}"),)))
    except grpc.RpcError as exc:
        details = exc.details()
        # gRPC puts a tenant refusal's OpenAI code in front of its message.
        return HTTP_STATUS_OF_GRPC[exc.code()], details.split(": ", 1)[1] if exc.code() in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ) else details
    return 200, "".join(r.text for r in replies)


def test_both_frontends_answer_every_request_alike(frontends):
    url, stub, reserved = frontends
    for name, (fields, key) in CASES.items():
        start = len(reserved)
        via_http = over_http(url, fields, key)
        http_reserved = reserved[start:]
        via_grpc = over_grpc(stub, fields, key)
        grpc_reserved = reserved[start + len(http_reserved) :]
        assert via_http[0] == via_grpc[0], (name, via_http, via_grpc)
        if via_http[0] == 200 or name != "unknown model":  # a 404 lists the served models either way
            # (the budget tenants' names differ by the frontend that each one belongs to)
            assert via_http[1] == via_grpc[1].replace("budget-grpc", "budget-http"), (name, via_http, via_grpc)
        assert http_reserved == grpc_reserved, (name, http_reserved, grpc_reserved)
        if name.startswith("budget"):
            assert http_reserved == [RESERVED], name
            assert via_http[0] == (429 if name == "budget 3" else 200), name


def test_both_frontends_report_a_requests_first_token_stages_when_asked(frontends):
    url, stub, _ = frontends
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "return_first_token_stages": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    (via_http,) = reply.json()["usage"]["first_token_stages"]
    metadata = (("authorization", f"Bearer {KEY}"),)
    for asked in (True, False):
        request = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=PROMPT), max_tokens=3, return_first_token_stages=asked)
        *_, last = stub.Generate(request, timeout=60, metadata=metadata)
        assert last.finished and dict(last.usage.first_token_stages) == (via_http if asked else {})
    assert via_http == FakeBackend.FIRST_TOKEN_STAGES  # what the backend's first chunk carried
