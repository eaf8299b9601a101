"""How a stream reaches the socket: one ASGI body message (one socket write) per chunk, sent
before the backend makes the next chunk; the chunk that ends the last choice goes out with
the usage chunk, [DONE] and the end of the body as one final message."""

from __future__ import annotations

import asyncio
import json

import pytest

from splitserve.cluster.frontend.http.api import build_http_app
from tests.helpers.http_api import MODEL_NAME, as_serving_api, parse_sse

pytestmark = pytest.mark.timeout(60)


def run_request(app, payload: dict, backend) -> list[dict]:
    """POST /v1/completions straight through the app's ASGI interface; the messages it sends,
    each body message with the number of chunks the backend had made when it was sent."""
    body = json.dumps(payload).encode()
    sent: list[dict] = []

    async def main() -> None:
        requested = False
        done = asyncio.Event()

        async def receive():
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()  # the client stays until the response is over
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append({**message, "num_made": backend.num_yielded})
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        await asyncio.wait_for(app(scope, receive, send), timeout=30)

    asyncio.run(main())
    return sent


def test_each_chunk_is_sent_before_the_next_is_made_and_the_end_is_one_write(backend):
    backend.token_interval_s = 0.001
    payload = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5, "stream": True}
    payload["stream_options"] = {"include_usage": True}
    sent = run_request(build_http_app(as_serving_api(backend)), payload, backend)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = sent[1:]
    assert all(m["type"] == "http.response.body" for m in bodies)
    # Tokens 1-4 each in their own message, sent while the backend had made just that many.
    assert [m["num_made"] for m in bodies[:4]] == [1, 2, 3, 4]
    assert all(m["more_body"] for m in bodies[:4])
    texts = [parse_sse(m["body"].decode()) for m in bodies[:4]]
    assert [[e["choices"][0]["text"] for e in t] for t in texts] == [
        [backend.expected_text(n)[len(backend.expected_text(n - 1)) :]] for n in range(1, 5)
    ]
    # The last token, its finish, the usage chunk and [DONE]: one message, which ends the body.
    assert len(bodies) == 5 and bodies[4]["more_body"] is False
    last = parse_sse(bodies[4]["body"].decode())
    assert last[0]["choices"][0]["finish_reason"] == "length" and last[0]["choices"][0]["text"]
    assert last[1]["choices"] == [] and last[1]["usage"]["completion_tokens"] == 5
    assert last[2:] == ["[DONE]"]
    # A normal finish to the backend: nothing closed it early.
    assert backend.closed_request_ids == []


def test_with_two_choices_only_the_last_finish_joins_the_end(backend):
    payload = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "n": 2, "stream": True}
    sent = run_request(build_http_app(as_serving_api(backend)), payload, backend)
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    events = [parse_sse(m["body"].decode()) for m in bodies]
    # 4 chunks (2 per choice): both first chunks (awaited together before the response
    # starts) in one message, the next alone, the fourth with [DONE], ending the body.
    assert [len(e) for e in events] == [2, 1, 2] and events[-1][-1] == "[DONE]"
    assert [m["more_body"] for m in bodies] == [True, True, False]
    assert sorted(e["choices"][0]["index"] for e in events[0]) == [0, 1]
    finishes = [e["choices"][0]["finish_reason"] for e in events[0] + events[1] + events[2][:1]]
    assert finishes.count("length") == 2 and finishes[-1] == "length"
