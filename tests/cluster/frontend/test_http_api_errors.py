"""The OpenAI-compatible HTTP frontend against a fake backend: bad requests and backend refusals as
errors in OpenAI's shape (status, type, param), unexpected errors, the API key, body limits, the
refused parameters. The `tokenizer`, `backend` and `client` fixtures are in conftest.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import HTTP_STATUS_BY_KIND, build_http_app
from splitserve.cluster.request_error import ErrorKind, RequestError
from tests.helpers.http_api import MODEL_NAME, FakeBackend, assert_error

pytestmark = pytest.mark.timeout(60)


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
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when stream"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
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
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "0 only with echo"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
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


def test_every_refused_parameter_is_refused_and_listed_in_the_readme(client):
    from pathlib import Path

    from splitserve.cluster.frontend.openai.unsupported import UNSUPPORTED_PARAMETERS

    readme = (Path(__file__).resolve().parents[3] / "docs" / "FEATURES.md").read_text()
    for name, (neutral, reason) in UNSUPPORTED_PARAMETERS.items():
        assert f"`{name}`" in readme, f"docs/FEATURES.md does not list the unsupported parameter {name}"
        ok = client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1, name: neutral[0]}
        )
        assert ok.status_code == 200, (name, ok.text)  # the neutral value changes nothing and is accepted
        bad = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", name: {"set": 1}})
        assert assert_error(bad, 400, param=name)["message"] == f"{name} is not supported: {reason}"
