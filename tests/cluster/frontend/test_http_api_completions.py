"""The OpenAI-compatible HTTP frontend against a fake backend: completion and chat response shapes,
sampling parameters, logprobs, SSE streams. Errors: test_http_api_errors.py; other routes:
test_http_api_routes.py; disconnects and the `openai` client: test_http_api_clients.py.
The `tokenizer`, `backend` and `client` fixtures are in conftest.py."""

from __future__ import annotations

import json
import logging

import pytest

from tests.helpers.http_api import MODEL_NAME, assert_error, parse_sse

pytestmark = pytest.mark.timeout(60)


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


def test_first_token_stages_are_reported_per_choice_only_when_asked(client, backend):
    stages = backend.first_token_stages
    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 3, "n": 2, "return_first_token_stages": True}
    usage = client.post("/v1/completions", json=body).json()["usage"]
    assert usage["first_token_stages"] == [stages, stages] and usage["completion_tokens"] == 6
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    usage = client.post("/v1/chat/completions", json={**chat, "return_first_token_stages": True}).json()["usage"]
    assert usage["first_token_stages"] == [stages]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = parse_sse(client.post("/v1/completions", json=streamed).text)
    assert events[-2]["usage"]["first_token_stages"] == [stages, stages]
    assert all("first_token_stages" not in (e.get("usage") or {}) for e in events[:-2])
    # Not asked: the usage is OpenAI's, with no such key.
    assert (
        "first_token_stages"
        not in client.post("/v1/completions", json={**body, "n": 1} | {"return_first_token_stages": False}).json()[
            "usage"
        ]
    )
    # With stream, the stages need the usage chunk: a clear 400, before any generation.
    num_calls = len(backend.calls)
    refused = client.post("/v1/completions", json={**body, "stream": True})
    assert_error(refused, 400, "invalid_request_error", param="return_first_token_stages")
    assert "include_usage" in refused.json()["error"]["message"] and len(backend.calls) == num_calls


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


def test_non_finite_logprobs_stay_valid_json(tokenizer):
    from splitserve.cluster.frontend.openai.completion_renderer import CompletionRenderer
    from splitserve.cluster.frontend.openai.render import MIN_LOGPROB, ChatRenderer
    from splitserve.proto.messages.handoff import StreamChunk

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
