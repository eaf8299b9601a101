"""The OpenAI-compatible HTTP frontend against a fake backend: response shapes, SSE streams,
errors in OpenAI's shape, API key, body limits. Disconnects and the `openai` client:
test_http_api_clients.py."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import HTTP_STATUS_BY_KIND, build_http_app
from splitserve.cluster.request_error import ErrorKind, RequestError
from tests.helpers.http_api import MODEL_NAME, FakeBackend, parse_sse, tiny_tokenizer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer)


@pytest.fixture
def client(backend):
    with TestClient(build_http_app(backend), raise_server_exceptions=False) as c:
        yield c


def assert_error(resp, status: int, error_type: str = "invalid_request_error", param=None):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# ---- completions / chat ----------------------------------------------------------------------


def test_completion_text_prompt(client, backend, tokenizer):
    backend.num_cached_tokens = 3
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL_NAME and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["text"] == backend.expected_text(5) and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    num_prompt = len(tokenizer.encode("hello world"))
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 5,
        "total_tokens": num_prompt + 5,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    call = backend.calls[0]
    assert call["prompt_token_ids"] == tokenizer.encode("hello world") and call["label"] is None
    assert call["params"].max_tokens == 5 and call["api_key"] is None


def test_client_request_id_is_a_label_echoed_back_with_the_ingress(client, backend, caplog):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="splitserve.access"):
        for stream in (False, True):
            resp = client.post("/v1/completions", json={**body, "stream": stream}, headers={"x-request-id": "mine-1"})
            assert resp.status_code == 200
            assert resp.headers["x-request-id"] == "mine-1" and resp.headers["x-splitserve-ingress"] == "fake-ingress"
    # Duplicates are harmless: the server's own ids differ, the label is only passed along and logged.
    assert [c["label"] for c in backend.calls] == ["mine-1", "mine-1"]
    assert len({c["request_id"] for c in backend.calls}) == 2
    assert "id=mine-1" in caplog.text
    plain = client.post("/v1/completions", json=body)
    assert "x-request-id" not in plain.headers and plain.headers["x-splitserve-ingress"] == "fake-ingress"
    assert backend.calls[-1]["label"] is None
    refused = client.post("/v1/completions", json={**body, "model": "nope"}, headers={"x-request-id": "mine-2"})
    assert refused.status_code == 404 and refused.headers["x-request-id"] == "mine-2"


def test_completion_token_prompt_and_sampling_params(client, backend):
    resp = client.post(
        "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": [5, 6, 7],
            "max_tokens": 100,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 4,
            "seed": 7,
            "stop": "xyz",
            "ignore_eos": True,
            "user": "u1",
            "presence_penalty": 0,
            "some_new_openai_field": {"x": 1},
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "length"
    params = backend.calls[0]["params"]
    assert backend.calls[0]["prompt_token_ids"] == [5, 6, 7]
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.stop, params.ignore_eos) == (
        0.5,
        0.9,
        4,
        7,
        ["xyz"],
        True,
    )
    # a list holding one prompt is one prompt; default max_tokens is 16; the reply ends with "stop"
    for prompt in (["hello"], [[5, 6]]):
        resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == backend.expected_text(len(backend.reply_ids))
        assert resp.json()["choices"][0]["finish_reason"] == "stop"
    assert backend.calls[-1]["params"].max_tokens == 16
    client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "seed": -1})
    assert backend.calls[-1]["params"].seed == 2**63 - 1  # any integer seed, reduced modulo 2**63
    # JSON numbers like 3.0 are integers (JSON Schema agrees); 3.5, "3" and true are not
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [5.0, 6], "max_tokens": 3.0})
    assert resp.status_code == 200 and backend.calls[-1]["prompt_token_ids"] == [5, 6]
    assert backend.calls[-1]["params"].max_tokens == 3


def test_chat_completion_uses_the_chat_template(client, backend, tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    resp = client.post(
        "/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_completion_tokens": 4}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": backend.expected_text(4)}
    assert body["choices"][0]["finish_reason"] == "length"
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}]
    )
    assert backend.calls[0]["prompt_token_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(backend.calls[0]["prompt_token_ids"])
    # without a limit a chat request may use the rest of the context
    client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages})
    assert backend.calls[1]["params"].max_tokens == backend.max_model_len - len(backend.calls[1]["prompt_token_ids"])


def test_logprobs_shapes(client, backend):
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 3, "logprobs": 0})
    lp = resp.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25, -0.5, -0.75] and lp["top_logprobs"] is None
    assert "".join(lp["tokens"]) == backend.expected_text(3)
    assert lp["text_offset"] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    resp = client.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True},
    )
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.25, -0.5]
    assert content[0]["bytes"] == list(content[0]["token"].encode()) and content[0]["top_logprobs"] == []


# ---- streaming -------------------------------------------------------------------------------


def test_stream_completion_with_usage(client, backend):
    backend.num_cached_tokens = 2
    resp = client.post(
        "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": "hello world",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(resp.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    chunks = events[:-2]
    assert len(chunks) == 4 and all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == backend.expected_text(4)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert len({c["id"] for c in events[:-1]}) == 1


def test_stream_chat_without_usage(client, backend):
    resp = client.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True},
    )
    events = parse_sse(resp.text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-1])
    assert text == backend.expected_text(len(backend.reply_ids))
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_error_after_the_first_chunk_becomes_an_sse_error_event(client, backend):
    backend.fail_after = 2
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 8, "stream": True})
    events = parse_sse(resp.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503 and "died" in events[-2]["error"]["message"]
    assert len(events) == 4
    # the same failure without streaming is a plain 503
    assert_error(
        client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 8}), 503, "server_error"
    )


# ---- other routes ----------------------------------------------------------------------------


def test_models_health_metrics_openapi(client, backend):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL_NAME
    assert models["data"][0]["max_model_len"] == backend.max_model_len
    assert client.get(f"/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME
    assert_error(client.get("/v1/models/other"), 404, param="model")
    assert client.get("/health").status_code == 200 and client.get("/health").json()["ok"] is True
    backend.healthy = False
    assert client.get("/health").status_code == 503
    client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert f'splitserve_generation_tokens_total{{model_name="{MODEL_NAME}"}} 2.0' in metrics.text
    schema = client.get("/openapi.json").json()
    assert {"CompletionRequest", "ChatCompletionRequest", "ErrorResponse"} <= set(schema["components"]["schemas"])
    assert "/v1/chat/completions" in schema["paths"]
    request_schemas = json.dumps(
        [schema["components"]["schemas"][n] for n in ("CompletionRequest", "ChatCompletionRequest")]
    )
    assert '"ge"' not in request_schemas and '"minimum": 1' in request_schemas  # real JSON Schema keywords
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL_NAME]


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, param, words",
    [
        ({"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "valid integer"),
        ({"prompt": "x", "max_tokens": 3.5}, "max_tokens", "valid integer"),
        ({"prompt": "x", "max_tokens": "16"}, "max_tokens", "valid integer"),
        ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options", "valid boolean"),
        ({}, "prompt", "required"),
        ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "x", "n": 129}, "n", "less than or equal to 128"),
        ({"prompt": ["a"] * 65, "n": 2}, "n", "prompts x n"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo", "prompt log-probabilities"),
        ({"prompt": "x", "best_of": 3}, "best_of", "equal to n"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, None, "token ids"),
        ({"prompt": "x", "logit_bias": {"999999": -100}}, None, "outside the vocabulary"),
        ({"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias", "valid number"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, None, "min_tokens"),
        ({"prompt": "x", "min_p": 0.1}, "min_p", "min_p is not supported"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search", "beam search"),
        ({"prompt": "x", "skip_special_tokens": False}, "skip_special_tokens", "not supported"),
        ({"prompt": "x", "suffix": "tail"}, "suffix", "not supported"),
        ({"prompt": ["a", [1]]}, "prompt", "list of such prompts"),
        ({"prompt": []}, "prompt", "at least 1"),
        ({"prompt": ""}, "prompt", "at least 1"),
        ({"prompt": "x", "stop": ""}, "stop", "at least 1"),
        ({"prompt": "x", "temperature": -1.0}, "temperature", "greater than or equal to 0"),
        ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": [999999]}, None, "outside the vocabulary"),
        ({"prompt": "x", "max_tokens": 5000}, None, "context"),
    ],
)
def test_completion_bad_requests_are_400(client, backend, payload, param, words):
    error = assert_error(client.post("/v1/completions", json={"model": MODEL_NAME, **payload}), 400, param=param)
    assert words in error["message"]
    assert backend.num_yielded == 0


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": "hello"}, "messages"),
    ],
)
def test_chat_bad_requests_are_400(client, payload, param):
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL_NAME, **payload}), 400, param=param)


def test_malformed_json_unknown_model_and_route(client):
    resp = client.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_error(resp, 400)["message"]
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    error = assert_error(client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, param="model")
    assert error["code"] == "model_not_found"
    assert_error(
        client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
        404,
        param="model",
    )
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.get("/v1/completions"), 405)


@pytest.mark.parametrize(
    "kind, status, error_type",
    [
        (ErrorKind.INVALID, 400, "invalid_request_error"),
        (ErrorKind.OVERLOADED, 429, "rate_limit_error"),
        (ErrorKind.UNAVAILABLE, 503, "server_error"),
        (ErrorKind.DEADLINE, 504, "timeout_error"),
        (ErrorKind.INTERNAL, 500, "server_error"),
    ],
)
def test_error_kinds_map_to_http_statuses(client, backend, kind, status, error_type):
    backend.refusal = RequestError(kind, f"refused: {kind}", retry_after_s=2.5)
    for stream in (False, True):
        resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "stream": stream})
        assert assert_error(resp, status, error_type)["message"] == f"refused: {kind}"
        # Every 429 and 503 tells the client when to come back (whole seconds, rounded up).
        assert resp.headers.get("retry-after") == ("3" if status in (429, 503) else None)


def test_every_kind_has_an_http_status():
    assert set(HTTP_STATUS_BY_KIND) == set(ErrorKind)


def test_unhealthy_503_carries_retry_after(client, backend):
    backend.healthy = False
    resp = client.get("/health")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"


def test_ready_is_serving_at_all_while_health_is_every_pool_at_its_floor(client, backend):
    assert client.get("/ready").status_code == 200  # no "serving" in the state: follows "ok"
    backend.healthy, backend.serving = False, True  # degraded: a pool lost a replica
    assert client.get("/health").status_code == 503
    ready = client.get("/ready")
    assert ready.status_code == 200 and ready.json()["serving"] is True
    backend.serving = False  # nothing can be served
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.headers["retry-after"] == "1"


def test_unexpected_errors_are_500_without_details(client, backend):
    backend.crash = RuntimeError("secret internal detail")
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
    error = assert_error(resp, 500, "server_error")
    assert "secret" not in resp.text and error["message"] == "internal server error"


def test_api_key(tokenizer):
    backend = FakeBackend(tokenizer, ServeConfig(api_key="sk-right"))
    with TestClient(build_http_app(backend)) as client:
        payload = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
        assert_error(client.post("/v1/completions", json=payload), 401)
        resp = client.post("/v1/completions", json=payload, headers={"Authorization": "Bearer sk-wrong"})
        assert assert_error(resp, 401)["code"] == "invalid_api_key"
        assert_error(client.get("/v1/models"), 401)
        assert backend.calls == []
        resp = client.post("/v1/completions", json=payload, headers={"Authorization": "Bearer sk-right"})
        assert resp.status_code == 200 and backend.calls[0]["api_key"] == "sk-right"
        assert client.get("/health").status_code == 200
        schemes = client.get("/openapi.json").json()["components"]["securitySchemes"]
        assert schemes["HTTPBearer"]["scheme"] == "bearer"


def test_oversized_bodies_are_413(tokenizer):
    backend = FakeBackend(tokenizer, ServeConfig(max_body_bytes=2048))
    with TestClient(build_http_app(backend)) as client:
        big = {"model": MODEL_NAME, "prompt": "word " * 1000}
        assert assert_error(client.post("/v1/completions", json=big), 413)["code"] == "request_too_large"

        def chunked():  # no Content-Length: the bytes actually received are counted
            data = json.dumps(big).encode()
            for i in range(0, len(data), 512):
                yield data[i : i + 512]

        assert_error(
            client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413
        )
        assert backend.calls == []
        assert client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "word"}).status_code == 200


def test_non_finite_logprobs_stay_valid_json(tokenizer):
    from splitserve.cluster.frontend.openai.render import MIN_LOGPROB, ChatRenderer, CompletionRenderer
    from splitserve.kvtransfer.handoff import StreamChunk

    chunk = StreamChunk(
        request_id="r",
        token_ids=[5, 6],
        text="ab",
        finished=True,
        finish_reason="stop",
        num_prompt_tokens=3,
        num_cached_tokens=0,
        num_output_tokens=2,
        logprobs=[float("-inf"), float("nan")],
    )
    for cls in (CompletionRenderer, ChatRenderer):
        renderer = cls("r", MODEL_NAME, 0, tokenizer, include_logprobs=True, include_usage=True)
        events = renderer.chunk_events(chunk) + renderer.closing_events()
        body = json.dumps(renderer.render_response(), allow_nan=False)
        assert str(MIN_LOGPROB) in body and all("Infinity" not in e and "NaN" not in e for e in events)


def test_every_refused_parameter_is_refused_and_listed_in_the_readme(client):
    from pathlib import Path

    from splitserve.cluster.frontend.openai.unsupported import UNSUPPORTED_PARAMETERS

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    for name, (neutral, reason) in UNSUPPORTED_PARAMETERS.items():
        assert f"`{name}`" in readme, f"README does not list the unsupported parameter {name}"
        ok = client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1, name: neutral[0]}
        )
        assert ok.status_code == 200, (name, ok.text)  # the neutral value changes nothing and is accepted
        bad = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", name: {"set": 1}})
        assert assert_error(bad, 400, param=name)["message"] == f"{name} is not supported: {reason}"


def test_access_log_quiets_scrapes_and_names_the_path(client, caplog):
    """Prometheus scrapes and health probes log at DEBUG; every other request at INFO with
    the path the client asked for (a 404 too), its status and duration."""
    caplog.set_level(logging.DEBUG, logger="splitserve.access")
    client.get("/metrics")
    client.get("/health")
    client.get("/v1/no/such/thing")
    client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "splitserve.access"]
    assert [(level, " ".join(msg.split()[:3])) for level, msg in lines] == [
        (logging.DEBUG, "GET /metrics 200"),
        (logging.DEBUG, "GET /health 200"),
        (logging.INFO, "GET /v1/no/such/thing 404"),
        (logging.INFO, "POST /v1/completions 200"),
    ]
    assert all(msg.endswith("ms") for _, msg in lines)
