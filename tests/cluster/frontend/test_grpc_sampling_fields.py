"""GenerateRequest's penalties, logit_bias, min_tokens and top_logprobs against a fake backend:
what reaches SamplingParams, what comes back per token, what is refused before the backend is
called, and a client built from reflection alone sends them. The same fields on a real cluster,
against HTTP: test_grpc_sampling_cluster.py."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.grpc.server import SERVICE_NAME
from splitserve.proto import load_stubs
from splitserve.proto.messages.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_ENTRIES, MAX_TOP_LOGPROBS
from tests.helpers.grpc_client import FAKE_LOGPROB, FakeBackend, fake_top_logprobs, serving_frontend

pb2, pb2_grpc = load_stubs()
TIMEOUT_S = 10
PROMPT_IDS = [10, 11, 12]


@pytest.fixture(scope="module")
def served(tokenizer):
    backend = FakeBackend(tokenizer, ServeConfig())
    with serving_frontend(backend) as (_, channel):
        yield backend, channel


@pytest.fixture
def backend(served):
    served[0].reset()
    return served[0]


@pytest.fixture
def stub(served, backend):
    return pb2_grpc.SplitServeStub(served[1])


def _generate(stub, **fields) -> list:
    request = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=PROMPT_IDS), max_tokens=3, **fields)
    return list(stub.Generate(request, timeout=TIMEOUT_S))


def test_unset_fields_take_the_engine_defaults(stub, backend):
    responses = _generate(stub, logprobs=True)
    params = backend.calls[-1][1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (params.logit_bias, params.min_tokens, params.top_logprobs) == ({}, 0, 0)
    assert all(not r.top_logprobs for r in responses)


def test_every_field_reaches_sampling_params(stub, backend):
    _generate(
        stub,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        repetition_penalty=1.25,
        logit_bias={5: -100.0, 7: 250.0, 9: 0.5},
        min_tokens=2,
        logprobs=True,
        top_logprobs=4,
    )
    params = backend.calls[-1][1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.5, 1.25)
    # Clamped to [-100, 100] as over HTTP (OpenAI's and vLLM's behaviour).
    assert params.logit_bias == {5: -100.0, 7: LOGIT_BIAS_LIMIT, 9: 0.5}
    assert (params.min_tokens, params.logprobs, params.top_logprobs) == (2, True, 4)
    # Explicit zeros are the "off" values, not refused.
    _generate(stub, presence_penalty=0.0, min_tokens=0, logprobs=True, top_logprobs=0)
    params = backend.calls[-1][1]
    assert (params.presence_penalty, params.min_tokens, params.top_logprobs) == (0.0, 0, 0)


def test_top_logprobs_come_back_per_token(stub, backend):
    responses = _generate(stub, logprobs=True, top_logprobs=3)
    tokens = [t for r in responses for t in r.token_ids]
    tops = [top for r in responses for top in r.top_logprobs]
    assert len(tops) == len(tokens) == 3
    for token, top in zip(tokens, tops):
        expected = fake_top_logprobs(token, 3)
        assert list(top.token_ids) == [t for t, _ in expected]
        assert list(top.logprobs) == pytest.approx([lp for _, lp in expected])
    assert [lp for r in responses for lp in r.logprobs] == [FAKE_LOGPROB] * 3


@pytest.mark.parametrize(
    "fields, details",
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be a number in [-2, 2]"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number > 0"),
        ({"min_tokens": 4}, "min_tokens must be an integer in [0, max_tokens=3]"),
        ({"logit_bias": {1: math.inf}}, "logit_bias values must be finite numbers"),
        ({"logit_bias": {1: math.nan}}, "logit_bias values must be finite numbers"),
        ({"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)}, "logit_bias may hold at most"),
        ({"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs must be an integer in [0, 20]"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs set to true"),
    ],
    ids=[
        "presence",
        "frequency",
        "frequency-nan",
        "repetition-zero",
        "repetition-inf",
        "min_tokens",
        "bias-inf",
        "bias-nan",
        "bias-entries",
        "top_logprobs",
        "top_logprobs-without-logprobs",
    ],
)
def test_bad_values_are_invalid_argument_before_the_backend(stub, backend, fields, details):
    with pytest.raises(grpc.RpcError) as err:
        _generate(stub, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details in err.value.details(), err.value.details()
    assert backend.calls == []


def test_a_reflection_only_client_sends_the_new_fields(served, backend):
    channel = served[1]
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    generate = pool.FindServiceByName(SERVICE_NAME).methods_by_name["Generate"]
    request_class = message_factory.GetMessageClass(generate.input_type)
    response_class = message_factory.GetMessageClass(generate.output_type)
    body = {
        "tokenIds": {"ids": PROMPT_IDS},
        "maxTokens": 2,
        "presencePenalty": 1.0,
        "logitBias": {"7": -100},
        "minTokens": 1,
        "logprobs": True,
        "topLogprobs": 2,
    }
    call = channel.unary_stream(
        f"/{SERVICE_NAME}/Generate",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    replies = [json_format.MessageToDict(r) for r in call(json_format.ParseDict(body, request_class()), timeout=10)]
    params = backend.calls[-1][1]
    assert (params.presence_penalty, params.logit_bias, params.min_tokens, params.top_logprobs) == (
        1.0,
        {7: -100.0},
        1,
        2,
    )
    assert [len(top["tokenIds"]) for r in replies for top in r["topLogprobs"]] == [2, 2]
