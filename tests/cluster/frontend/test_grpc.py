"""The gRPC frontend against a fake backend: streaming, status codes, auth, cancel, health,
a reflection-only client (what grpcurl does), malformed input, and the self-building stubs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.grpc.server import (
    INGRESS_KEY,
    RETRY_PUSHBACK_KEY,
    SERVICE_NAME,
    STATUS_CODE_BY_KIND,
    GrpcFrontend,
    GrpcFrontendError,
)
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.engine.builtin_models.make_model import write_random_checkpoint
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.proto import load_stubs
from tests.helpers.grpc_client import (
    FAKE_CACHED_TOKENS,
    FAKE_LOGPROB,
    FAKE_MAX_MODEL_LEN,
    FAKE_MODEL_NAME,
    FakeBackend,
    serving_frontend,
)

pb2, pb2_grpc = load_stubs()
API_KEY = "sk-test-key"
MAX_BODY_BYTES = 4096
TIMEOUT_S = 10
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model_dir = write_random_checkpoint(tmp_path_factory.mktemp("grpc-model"), preset="tiny")
    return Tokenizer.from_pretrained(model_dir)


def _backend(tokenizer, **cfg) -> FakeBackend:
    return FakeBackend(tokenizer, ServeConfig(max_body_bytes=MAX_BODY_BYTES, **cfg))


@pytest.fixture(scope="module")
def served(tokenizer):
    backend = _backend(tokenizer)
    with serving_frontend(backend) as (server, channel):
        yield backend, server, channel


@pytest.fixture
def backend(served):
    served[0].reset()
    return served[0]


@pytest.fixture
def stub(served, backend):
    return pb2_grpc.SplitServeStub(served[2])


@pytest.fixture(scope="module")
def keyed(tokenizer):
    backend = _backend(tokenizer, api_key=API_KEY)
    with serving_frontend(backend) as (_, channel):
        yield backend, channel


def _stream(stub, **request):
    return list(stub.Generate(pb2.GenerateRequest(**request), timeout=TIMEOUT_S))


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_generate_streams_deltas_and_usage_last(stub, backend, tokenizer):
    prompt = "The quick brown fox"
    prompt_ids = tokenizer.encode(prompt)
    responses = _stream(
        stub,
        text=prompt,
        max_tokens=4,
        temperature=0.0,
        top_k=5,
        seed=7,
        stop=["\n"],
        stop_token_ids=[3],
        ignore_eos=True,
        logprobs=True,
        request_id="req-1",
    )
    assert [r.finished for r in responses] == [False, False, False, True]
    assert [r.request_id for r in responses] == ["req-1"] * 4
    token_ids = [t for r in responses for t in r.token_ids]
    assert token_ids == [prompt_ids[i % len(prompt_ids)] for i in range(4)]
    assert [r.text for r in responses] == [tokenizer.decode([t]) for t in token_ids]
    assert [list(r.logprobs) for r in responses] == [[FAKE_LOGPROB]] * 4
    assert [r.finish_reason for r in responses] == ["", "", "", "length"]
    assert not any(r.HasField("usage") for r in responses[:-1])
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (
        len(prompt_ids),
        4,
        FAKE_CACHED_TOKENS,
    )
    ids, params, label, api_key = backend.calls[-1]
    assert ids == prompt_ids and label == "req-1" and api_key is None  # a label, echoed back
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (4, 0.0, 5, 7)
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.logprobs) == (["\n"], [3], True, True)
    assert backend.outcomes == ["completed"]


def test_generate_token_ids_with_engine_defaults(stub, backend):
    responses = _stream(stub, token_ids=pb2.TokenIds(ids=[10, 11, 12]), model=FAKE_MODEL_NAME)
    assert len(responses) == 16 and responses[-1].usage.completion_tokens == 16
    assert all(not r.logprobs for r in responses)
    ids, params, label, _ = backend.calls[-1]
    assert ids == [10, 11, 12] and label is None and responses[0].request_id == "fake-1"  # the server's id
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)


def test_tokenize_and_models(stub, tokenizer):
    response = stub.Tokenize(pb2.TokenizeRequest(text="Hello world"), timeout=TIMEOUT_S)
    assert list(response.token_ids) == tokenizer.encode("Hello world")
    assert response.count == len(response.token_ids) and response.max_model_len == FAKE_MAX_MODEL_LEN
    models = stub.Models(pb2.ModelsRequest(), timeout=TIMEOUT_S).models
    assert [(m.id, m.max_model_len, m.owned_by) for m in models] == [
        (FAKE_MODEL_NAME, FAKE_MAX_MODEL_LEN, "splitserve")
    ]


@pytest.mark.parametrize(
    "request_fields, code, details",
    [
        ({"text": "hi", "model": "gpt-9"}, Code.NOT_FOUND, "gpt-9"),
        ({"max_tokens": 2}, Code.INVALID_ARGUMENT, "set the prompt"),
        ({"text": ""}, Code.INVALID_ARGUMENT, "empty"),
        ({"token_ids": pb2.TokenIds()}, Code.INVALID_ARGUMENT, "token_ids is empty"),
        ({"text": "hi", "top_p": 0.0}, Code.INVALID_ARGUMENT, "top_p"),
        ({"text": "hi", "max_tokens": 0}, Code.INVALID_ARGUMENT, "max_tokens"),
        ({"text": "hi", "temperature": float("nan")}, Code.INVALID_ARGUMENT, "temperature"),
        ({"text": "hi", "seed": 2**63}, Code.INVALID_ARGUMENT, "seed"),
        (
            {"token_ids": pb2.TokenIds(ids=[1]), "max_tokens": FAKE_MAX_MODEL_LEN},
            Code.INVALID_ARGUMENT,
            "context length",
        ),
        ({"token_ids": pb2.TokenIds(ids=[10**6])}, Code.INVALID_ARGUMENT, "out of range"),
    ],
)
def test_generate_rejects_bad_requests(stub, backend, request_fields, code, details):
    got_code, got_details = _status(lambda: _stream(stub, **request_fields))
    assert got_code == code and details in got_details
    assert backend.calls == []


@pytest.mark.parametrize(
    "error, code",
    [
        (RequestError(ErrorKind.INVALID, "bad prompt"), Code.INVALID_ARGUMENT),
        (RequestError(ErrorKind.OVERLOADED, "the server is at capacity; retry later"), Code.RESOURCE_EXHAUSTED),
        (RequestError(ErrorKind.UNAVAILABLE, "no decode replica"), Code.UNAVAILABLE),
        (RequestError(ErrorKind.DEADLINE, "too slow"), Code.DEADLINE_EXCEEDED),
        (RequestError(ErrorKind.INTERNAL, "kv transfer failed"), Code.INTERNAL),
        (RuntimeError("a bug"), Code.INTERNAL),
    ],
)
def test_error_kinds_map_to_status_codes(stub, backend, error, code):
    backend.refusal = error
    call = stub.Generate(pb2.GenerateRequest(text="hi", max_tokens=2), timeout=TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as failed:
        list(call)
    assert failed.value.code() == code
    if isinstance(error, RequestError):
        assert str(error) in failed.value.details()
    else:  # a bug: the client gets a short message; the traceback stays in the server log
        assert "a bug" not in failed.value.details() and "internal error" in failed.value.details()
    # Retryable kinds carry gRPC's Retry-After: the retry pushback in the trailers.
    trailers = dict(failed.value.trailing_metadata() or ())
    assert trailers[INGRESS_KEY] == backend.ingress_id
    pushback = trailers.get(RETRY_PUSHBACK_KEY)
    retryable = isinstance(error, RequestError) and error.retryable
    assert pushback == ("1000" if retryable else None)


def test_every_kind_has_a_status_code():
    assert set(STATUS_CODE_BY_KIND) == set(ErrorKind)


def test_failure_after_first_chunk_ends_stream_with_status(stub, backend):
    backend.mid_stream_failure = RequestError(ErrorKind.UNAVAILABLE, "decode replica died")
    call = stub.Generate(pb2.GenerateRequest(text="hello there", max_tokens=5), timeout=TIMEOUT_S)
    assert len(next(call).token_ids) == 1
    assert _status(lambda: list(call)) == (Code.UNAVAILABLE, "decode replica died")


def test_client_cancel_closes_backend_generator(stub, backend):
    backend.chunk_delay_s = 0.05
    call = stub.Generate(pb2.GenerateRequest(text="hello", max_tokens=50), timeout=TIMEOUT_S)
    next(call)
    call.cancel()
    assert backend.stream_ended.wait(5), "the backend stream was not closed after the client cancelled"
    assert backend.outcomes and backend.outcomes[0] != "completed"


def test_api_key(keyed):
    backend, channel = keyed
    stub = pb2_grpc.SplitServeStub(channel)
    request = pb2.GenerateRequest(text="hi", max_tokens=2)
    for metadata, details in [
        (None, "missing API key"),
        ((("authorization", "Bearer nope"),), "invalid API key"),
        ((("authorization", API_KEY),), "missing API key"),
    ]:
        code, got_details = _status(lambda md=metadata: list(stub.Generate(request, metadata=md, timeout=TIMEOUT_S)))
        assert code == Code.UNAUTHENTICATED and details in got_details
        assert (
            _status(lambda md=metadata: stub.Models(pb2.ModelsRequest(), metadata=md, timeout=TIMEOUT_S))[0]
            == Code.UNAUTHENTICATED
        )
    good = (("authorization", f"Bearer {API_KEY}"),)
    assert len(list(stub.Generate(request, metadata=good, timeout=TIMEOUT_S))) == 2
    assert backend.calls[-1][3] == API_KEY
    assert stub.Tokenize(pb2.TokenizeRequest(text="hi"), metadata=good, timeout=TIMEOUT_S).count > 0
    # Health and reflection stay open: load balancers and grpcurl carry no key.
    health = health_pb2_grpc.HealthStub(channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status
        == health_pb2.HealthCheckResponse.SERVING
    )


def test_health_check_and_watch_follow_backend(served, backend):
    health = health_pb2_grpc.HealthStub(served[2])
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S).status == SERVING
    assert (
        _status(lambda: health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=TIMEOUT_S))[0]
        == Code.NOT_FOUND
    )
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT_S)
    assert next(watch).status == SERVING
    backend.healthy = False  # picked up by the poller, no Check needed
    assert next(watch).status == NOT_SERVING
    watch.cancel()
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status == NOT_SERVING
    backend.healthy = RuntimeError("router unreachable")
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status == NOT_SERVING
    backend.healthy = True
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status == SERVING


def test_client_built_only_from_reflection(served, backend, tokenizer):
    channel = served[2]
    database = ProtoReflectionDescriptorDatabase(channel)
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(database.get_services())
    pool = descriptor_pool.DescriptorPool(database)

    def method(service_name: str, method_name: str):
        found = pool.FindServiceByName(service_name).methods_by_name[method_name]
        return (
            found,
            message_factory.GetMessageClass(found.input_type),
            message_factory.GetMessageClass(found.output_type),
        )

    generate, request_class, response_class = method(SERVICE_NAME, "Generate")
    assert request_class is not pb2.GenerateRequest and generate.server_streaming
    request = json_format.ParseDict({"text": "Hello", "maxTokens": 3, "temperature": 0}, request_class())
    call = channel.unary_stream(
        f"/{SERVICE_NAME}/Generate",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    replies = [json_format.MessageToDict(r) for r in call(request, timeout=TIMEOUT_S)]
    assert len(replies) == 3 and replies[-1]["finished"] and replies[-1]["finishReason"] == "length"
    assert replies[-1]["usage"]["promptTokens"] == len(tokenizer.encode("Hello"))
    assert backend.calls[-1][1].temperature == 0.0

    _, check_request, check_response = method("grpc.health.v1.Health", "Check")
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=check_request.SerializeToString,
        response_deserializer=check_response.FromString,
    )
    assert json_format.MessageToDict(check(check_request(), timeout=TIMEOUT_S)) == {"status": "SERVING"}


@pytest.mark.parametrize(
    "method, garbage",
    [
        ("Generate", b"\x0a\xff"),  # field 1: a 255-byte string with 0 bytes behind it
        ("Generate", b"\x12\x02\xff\xfe"),  # field 2 (text): invalid UTF-8
        ("Generate", b"\xff\xff\xff\xff"),
        ("Tokenize", b"\x0a\xff"),
    ],
)
def test_malformed_bytes_are_invalid_argument_and_server_keeps_serving(served, stub, method, garbage):
    channel = served[2]
    path = f"/{SERVICE_NAME}/{method}"
    # No serializers: the raw bytes go on the wire as they are.
    call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)
    code, details = _status(
        lambda: list(call(garbage, timeout=TIMEOUT_S)) if method == "Generate" else call(garbage, timeout=TIMEOUT_S)
    )
    assert code == Code.INVALID_ARGUMENT and "malformed" in details
    assert len(_stream(stub, text="still up", max_tokens=2)) == 2


def test_oversized_message_is_refused_by_grpc(stub):
    code, _ = _status(lambda: _stream(stub, text="x" * (MAX_BODY_BYTES + 1)))
    assert code == Code.RESOURCE_EXHAUSTED
    assert stub.Models(pb2.ModelsRequest(), timeout=TIMEOUT_S).models


def test_busy_port_and_double_start_fail_clearly(served, backend):
    server = served[1]
    with pytest.raises(GrpcFrontendError, match="already serving"):
        server.call(server.frontend.start("127.0.0.1", 0))
    with pytest.raises(GrpcFrontendError, match="cannot listen"):
        server.call(GrpcFrontend(backend).start("127.0.0.1", server.port))


def test_stop_cancels_streams_in_flight(tokenizer):
    backend = _backend(tokenizer)
    with serving_frontend(backend) as (server, channel):
        backend.chunk_delay_s = 0.05
        call = pb2_grpc.SplitServeStub(channel).Generate(
            pb2.GenerateRequest(text="hi", max_tokens=50), timeout=TIMEOUT_S
        )
        next(call)
        server.call(server.frontend.stop(grace_s=0.1))
        assert backend.stream_ended.wait(5) and backend.outcomes[0] != "completed"
        assert _status(lambda: list(call))[0] in (Code.UNAVAILABLE, Code.CANCELLED)


def test_stubs_build_when_missing_and_rebuild_when_proto_changes(tmp_path):
    package = tmp_path / "api_copy"  # a copy under another name: the stubs import relatively
    package.mkdir()
    source = Path(__file__).resolve().parents[3] / "proto"
    for name in ("__init__.py", "build.py", "stubs.py", "splitserve.proto"):
        shutil.copy(source / name, package / name)
    load = (
        "from api_copy import load_stubs; pb2, pb2_grpc = load_stubs(); "
        "print(pb2.__file__, pb2_grpc.SplitServeStub.__name__, 'Extra' in pb2.DESCRIPTOR.message_types_by_name)"
    )

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr
        return done.stdout

    assert run("-c", load).split() == [str(package / "splitserve_pb2.py"), "SplitServeStub", "False"]
    with open(package / "splitserve.proto", "a") as f:
        f.write("message Extra {}\n")
    assert run("-c", load).split()[-1] == "True"
    assert "api_copy/splitserve_pb2_grpc.py" in run("-m", "api_copy.build", "--force")
