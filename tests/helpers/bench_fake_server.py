"""A small fake OpenAI-compatible streaming server for the bench tests.

Streams one SSE chunk per output token after `ttft_s`, `itl_s` apart, then a usage chunk with
prompt_tokens_details.cached_tokens from an emulated prefix cache (16-token blocks), then [DONE].
Rejects token ids >= vocab_size with 400 like vLLM. Exposes /health, /v1/models and /metrics
(`fake_requests_in_flight{replica=...}`). Runs in a thread (FakeServerThread) or as a script;
`--stubborn` instead serves only /health and ignores SIGINT and SIGTERM, to test escalation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

CACHE_BLOCK = 16
NUM_REPLICAS = 2


@dataclass
class FakeServerState:
    ttft_s: float = 0.01
    itl_s: float = 0.002
    vocab_size: int = 50_000
    model: str = "fake-model"
    token_text: str = " tok{i}"  # the i-th output token's text
    seen_blocks: set[tuple[int, ...]] = field(default_factory=set)
    in_flight: list[int] = field(default_factory=lambda: [0] * NUM_REPLICAS)
    num_requests: int = 0

    def cached_tokens(self, units: list[Any]) -> int:
        """Leading full blocks seen before (then remember this prompt's blocks)."""
        num_blocks = len(units) // CACHE_BLOCK
        cached = 0
        for k in range(1, num_blocks + 1):
            if tuple(units[: k * CACHE_BLOCK]) not in self.seen_blocks:
                break
            cached = k * CACHE_BLOCK
        for k in range(1, num_blocks + 1):
            self.seen_blocks.add(tuple(units[: k * CACHE_BLOCK]))
        return min(cached, len(units) - 1)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": status}}, status)


def create_app(state: FakeServerState) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = ["# TYPE fake_requests_in_flight gauge"]
        lines += [f'fake_requests_in_flight{{replica="r{i}"}} {n}' for i, n in enumerate(state.in_flight)]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def stream(body: dict[str, Any], chat: bool) -> Any:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _error(400, "messages must be a non-empty list")
            units: list[Any] = " ".join(str(m.get("content", "")) for m in messages).split()
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
                if max(prompt) >= state.vocab_size or min(prompt) < 0:
                    return _error(400, f"token id out of vocabulary [0, {state.vocab_size})")
                units = prompt
            elif isinstance(prompt, str) and prompt:
                units = prompt.split()
            else:
                return _error(400, "prompt must be a non-empty string or list of token ids")
        if not body.get("stream"):
            return _error(400, "the fake server only streams")
        max_tokens = int(body.get("max_tokens") or 16)
        cached = state.cached_tokens(units)
        replica = state.num_requests % NUM_REPLICAS
        state.num_requests += 1
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            chunk = {"id": "cmpl-fake", "object": kind, "model": state.model, "choices": choices}
            if include_usage:
                chunk["usage"] = usage
            # Non-ASCII text raw, as splitserve's and vLLM's JSON encoders send it.
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        async def chunks():
            state.in_flight[replica] += 1
            try:
                if chat:
                    yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
                await asyncio.sleep(state.ttft_s)
                for i in range(max_tokens):
                    if i:
                        await asyncio.sleep(state.itl_s)
                    finish = "length" if i == max_tokens - 1 else None
                    text = state.token_text.format(i=i)
                    choice = (
                        {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                        if chat
                        else {"index": 0, "text": text, "finish_reason": finish}
                    )
                    yield event([choice])
                if include_usage:
                    yield event(
                        [],
                        {
                            "prompt_tokens": len(units),
                            "completion_tokens": max_tokens,
                            "total_tokens": len(units) + max_tokens,
                            "prompt_tokens_details": {"cached_tokens": cached},
                        },
                    )
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight[replica] -= 1

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await stream(await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await stream(await request.json(), chat=True)

    return app


class FakeServerThread:
    """uvicorn on 127.0.0.1, an OS-chosen port, in a daemon thread."""

    def __init__(self, state: FakeServerState | None = None) -> None:
        self.state = state or FakeServerState()
        config = uvicorn.Config(create_app(self.state), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> FakeServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10.0
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start within 10 s")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10.0)


def _serve_stubborn(host: str, port: int) -> None:
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    HTTPServer((host, port), Health).serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=10.0)
    parser.add_argument("--itl-ms", type=float, default=2.0)
    parser.add_argument("--pid-file")
    parser.add_argument("--stubborn", action="store_true")
    args = parser.parse_args()
    if args.pid_file:
        with open(args.pid_file, "w") as handle:
            handle.write(str(os.getpid()))
    if args.stubborn:
        _serve_stubborn(args.host, args.port)
        return
    state = FakeServerState(ttft_s=args.ttft_ms / 1000.0, itl_s=args.itl_ms / 1000.0)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
