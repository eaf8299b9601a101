"""Malformed gRPC messages, the hostile constraints of issue #28 over HTTP and gRPC while two
streams are in flight, and the secure defaults, against the real frontends over a real tiny
1P+1D cluster (the package's conftest)."""

from __future__ import annotations

import json
import os
import pickle
import re
import threading
import time

import grpc
import httpx
import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.proto import load_stubs
from splitserve.proto.messages.request_channel import ChannelError, Submit, decode_to_decode, encode_frame
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import wait_for_baseline, wait_until
from tests.helpers.hostile_cases import HOSTILE_GRPC, HOSTILE_HTTP, MALFORMED_GRPC
from tests.helpers.hostile_server import (
    AUTH,
    GRPC_AUTH,
    MAX_BODY_BYTES,
    assert_openai_error,
    normal_request_works,
    ray_get,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
pb2, pb2_grpc = load_stubs()


def test_malformed_grpc_messages_are_invalid_argument(grpc_port, backend):
    metadata = GRPC_AUTH
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
    request = Submit(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams())
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
        wait_until(lambda: backend.num_inflight == 2, None, "the two streams were not admitted")
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
        metadata = GRPC_AUTH
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
