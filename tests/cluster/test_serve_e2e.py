"""`splitserve serve` (1P+1D on CPU) as users run and reach it: installed from a wheel (not
editable) into a folder of its own, started outside the repository, called with the
unmodified openai client and a gRPC client built only from server reflection; error bodies,
the access log, and a clean Ctrl-C."""

from __future__ import annotations

import json
import subprocess
import time

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.serve_process import ServeProcess
from tests.helpers.wheel import install_wheel

pytestmark = pytest.mark.ray
PROMPT = "Once upon a time"
MAX_MODEL_LEN = 512  # below the tiny model's 1024: --max-model-len must reach the frontend


@pytest.fixture(scope="module")
def wheel(tmp_path_factory, wheel_builds):
    return install_wheel(tmp_path_factory.mktemp("wheel"), wheel_builds.wheel())


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, wheel):
    proc = ServeProcess(
        tiny_model,
        tmp_path_factory.mktemp("serve") / "serve.log",
        "--prefill-replicas",
        "1",
        "--decode-replicas",
        "1",
        "--router",
        "kv",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        python=wheel.python,
        env=wheel.env(),
    )
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
    log = proc.log_path.read_text()
    assert "shutting down" in log
    # Ctrl-C ends quietly: no traceback, no "ServeController.graceful_shutdown failed".
    assert "Traceback" not in log and "graceful_shutdown" not in log, log[-3000:]


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def expected(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN))
    return engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_server_runs_from_the_installed_wheel(server, wheel, tmp_path):
    """Only `splitserve` (and its dist-info, console script) lands in the target folder, the
    interpreter has no other copy, and every splitserve module the server imports is DIR's."""
    assert {p.name for p in wheel.site_dir.iterdir()} <= {
        "splitserve",
        wheel.wheel.name.split("-py3")[0] + ".dist-info",
        "bin",
    }
    alone = subprocess.run([str(wheel.python), "-c", "import splitserve"], cwd=tmp_path, capture_output=True)
    assert alone.returncode != 0  # no editable install behind the wheel's back
    probe = (
        "import json, sys, splitserve.cluster.app, splitserve.cluster.frontend.backend, "
        "splitserve.cluster.frontend.http.api, splitserve.cluster.frontend.grpc.server, "
        "splitserve.prefill.prefill_worker, splitserve.decode.decode_worker, proto; "
        "print(json.dumps({n: getattr(m, '__file__', None) for n, m in sys.modules.items() "
        "if n == 'proto' or n.startswith('splitserve')}))"
    )
    res = subprocess.run(
        [str(wheel.python), "-c", probe], cwd=tmp_path, env=wheel.env(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    files = json.loads(res.stdout)
    ours = {name: path for name, path in files.items() if name.startswith("splitserve") and path}
    assert len(ours) > 40 and all(path.startswith(str(wheel.site_dir)) for path in ours.values()), ours
    assert not files["proto"].startswith(str(wheel.site_dir))  # proto-plus keeps its name


def test_model_id_is_the_model_as_given(client, tiny_model):
    (card,) = client.models.list().data
    assert card.id == tiny_model  # the path string, as vLLM does; --served-model-name overrides


def test_max_model_len_reaches_the_frontend(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == MAX_MODEL_LEN
        res = http.post("/v1/completions", json={"model": card["id"], "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN})
        assert res.status_code == 400 and str(MAX_MODEL_LEN) in res.json()["error"]["message"]


def test_access_log_names_the_path_and_skips_scrapes(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/no/such/path").status_code == 404
        http.get("/metrics")
        http.get("/health")
    deadline = time.monotonic() + 30  # Ray forwards the replica's log lines within a second or so
    while "GET /no/such/path 404" not in server.log_path.read_text():
        assert time.monotonic() < deadline, server.log_path.read_text()[-3000:]
        time.sleep(0.5)
    log = server.log_path.read_text()
    assert "GET /metrics" not in log and "GET /health" not in log  # DEBUG, below the default INFO
    # Ray's start-up chatter stays in its log files: no token-auth warning, no Serve INFO lines.
    assert "Token authentication" not in log and "Started Serve" not in log


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
        assert "splitserve_router_indexed_blocks{" in metrics
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
