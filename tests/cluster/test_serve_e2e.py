"""`splitserve serve` (1P+1D on CPU) as users reach it: the unmodified openai client, a gRPC
client built only from server reflection, error bodies, and a clean Ctrl-C."""

from __future__ import annotations

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from splitserve.engine.config import EngineConfig
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from tests.helpers.serve_process import ServeProcess

pytestmark = pytest.mark.ray
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    proc = ServeProcess(
        tiny_model,
        tmp_path_factory.mktemp("serve") / "serve.log",
        "--prefill-replicas",
        "1",
        "--decode-replicas",
        "1",
        "--router",
        "kv",
    )
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
    assert "shutting down" in proc.log_path.read_text()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def expected(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, num_gpu_blocks=64))
    return engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_openai_completion_equals_generate(client, expected):
    res = client.completions.create(
        model=model_name(client), prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert res.choices[0].text == expected.text
    assert res.usage.completion_tokens == 16 and res.choices[0].finish_reason == "length"


def test_openai_stream_and_chat(client, expected):
    stream = client.completions.create(
        model=model_name(client),
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected.text
    chat = client.chat.completions.create(
        model=model_name(client), max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Say hello"}]
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=model_name(client),
            max_tokens=8,
            temperature=0,
            stream=True,
            messages=[{"role": "user", "content": "Say hello"}],
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content


def test_cached_tokens_reported_on_repeat(client):
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    client.completions.create(model=model_name(client), prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_errors_are_openai_shaped_and_server_keeps_serving(server, client):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        name = http.get("/v1/models").json()["data"][0]["id"]
        cases = [
            ({"model": name, "prompt": PROMPT, "max_tokens": 10**7}, 400),
            ({"model": "no-such-model", "prompt": PROMPT}, 404),
            ({"model": name, "prompt": PROMPT, "temperature": -1}, 400),
            ({"model": name, "prompt": ""}, 400),
        ]
        for body, status in cases:
            res = http.post("/v1/completions", json=body)
            assert res.status_code == status, res.text
            assert set(res.json()["error"]) >= {"message", "type"}
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics").text
        assert "splitserve_ttft_seconds" in metrics and "splitserve_router_decisions" in metrics
    assert client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=2).choices


def test_grpc_client_from_reflection_only(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    try:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))

        def method(service: str, name: str):
            found = pool.FindServiceByName(service).methods_by_name[name]
            return (
                message_factory.GetMessageClass(found.input_type),
                message_factory.GetMessageClass(found.output_type),
            )

        req_cls, resp_cls = method("splitserve.v1.SplitServe", "Generate")
        call = channel.unary_stream(
            "/splitserve.v1.SplitServe/Generate",
            request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString,
        )
        request = json_format.ParseDict(
            {"text": PROMPT, "maxTokens": 5, "temperature": 0, "ignoreEos": True}, req_cls()
        )
        replies = [json_format.MessageToDict(r) for r in call(request, timeout=60)]
        assert replies[-1]["finished"] and replies[-1]["usage"]["completionTokens"] == 5
        check_req, check_resp = method("grpc.health.v1.Health", "Check")
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=check_req.SerializeToString,
            response_deserializer=check_resp.FromString,
        )
        assert json_format.MessageToDict(check(check_req(), timeout=10)) == {"status": "SERVING"}
    finally:
        channel.close()
