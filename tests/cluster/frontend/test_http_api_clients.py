"""The HTTP frontend with real clients: a client that disconnects cancels its generation
(streaming and not), and the official `openai` client against uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.http.sse import SSEResponse
from tests.helpers.http_api import MODEL_NAME, FakeBackend, ServerThread

pytestmark = pytest.mark.timeout(60)


# ---- disconnects -----------------------------------------------------------------------------


def test_stream_disconnect_closes_the_backend_generator(backend):
    backend.hang_after = 2
    with ServerThread(build_http_app(backend)) as server:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            payload = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 50, "stream": True}
            with http.stream("POST", "/v1/completions", json=payload) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
            # leaving the block closes the connection mid-stream
        assert backend.closed_early.wait(5.0), "the backend generator was not closed"
        assert backend.closed_request_ids == [backend.calls[0]["request_id"]]


def test_non_stream_disconnect_closes_the_backend_generator(backend):
    backend.hang_after = 1
    app = build_http_app(backend)
    body = json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 50}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        while backend.num_yielded < 1:
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    assert backend.closed_request_ids == [backend.calls[0]["request_id"]]


# ---- the official openai client --------------------------------------------------------------


def test_openai_client(tokenizer):
    backend = FakeBackend(tokenizer, ServeConfig(api_key="sk-test"))
    backend.num_cached_tokens = 1
    with ServerThread(build_http_app(backend)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=10)
        assert [m.id for m in client.models.list()] == [MODEL_NAME]
        completion = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3)
        assert completion.choices[0].text == backend.expected_text(3)
        assert completion.usage.prompt_tokens_details.cached_tokens == 1
        chat = client.chat.completions.create(
            model=MODEL_NAME, max_tokens=3, logprobs=True, messages=[{"role": "user", "content": "hi"}]
        )
        assert chat.choices[0].message.content == backend.expected_text(3)
        assert chat.choices[0].finish_reason == "length" and len(chat.choices[0].logprobs.content) == 3
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "hi"}],
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == backend.expected_text(4)
        assert chunks[-1].usage.completion_tokens == 4
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=5, stream=True)
        )
        assert text == backend.expected_text(5)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hello")
        with pytest.raises(openai.BadRequestError, match="beam search"):
            client.completions.create(model=MODEL_NAME, prompt="hello", extra_body={"use_beam_search": True})
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
        backend.fail_after = 1
        with pytest.raises(openai.APIError, match="died"):
            list(client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=5, stream=True))


def test_sse_response_closes_a_source_parked_at_yield():
    """A client that leaves while the server is blocked sending: the event generator and the
    backend generator are both parked at a `yield`, and must still be closed at once."""
    closed = []

    async def source():
        try:
            for i in range(100):
                yield i
        finally:
            closed.append("source")

    async def events(gen):
        try:
            async for i in gen:
                yield f"data: {i}\n\n"
        finally:
            closed.append("events")

    async def main():
        gen = source()
        left = asyncio.Event()
        sent = []

        async def send(message):
            sent.append(message)
            if message.get("body"):
                left.set()
                await asyncio.sleep(3600)  # a client that stopped reading

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
        await asyncio.wait_for(SSEResponse(events(gen), source=gen)(scope, receive, send), timeout=10)
        # checked inside the loop: asyncio.run's shutdown would close leftover generators anyway
        assert sorted(closed) == ["events", "source"]
        return sent

    sent = asyncio.run(main())
    assert sent[0]["type"] == "http.response.start" and sent[1]["body"] == b"data: 0\n\n"
