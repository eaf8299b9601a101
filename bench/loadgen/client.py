"""BenchClient: sends BenchRequests to an OpenAI-compatible server and records streamed timings.

Streams Server-Sent Events from /v1/completions (prompt as a list of token ids, or text) or
/v1/chat/completions, asking for `stream_options.include_usage` so the final chunk reports
prompt, completion and cached tokens. A run is bounded by `max_requests` and `max_seconds`;
requests still in flight at the bound are cancelled and recorded with error "deadline".

Text prompts (chat, or --prompt-format text) come from PromptTextRenderer: with a tokenizer
(a tokenizer.json file, or a directory holding one) the ids are decoded by it, so the server
re-tokenizes to about the same ids; without one each id becomes a fixed pseudo-word. Either way
equal id prefixes give equal text prefixes, which keeps prefix sharing intact.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from splitserve.bench.loadgen.records import (
    DEADLINE_ERROR,
    DEFAULT_BASE_URL,
    ENDPOINT_PATHS,
    PROMPT_FORMATS,
    BenchRequest,
    ClientOptions,
    LoadPoint,
    RequestRecord,
    RunResult,
)
from splitserve.bench.loadgen.run_scheduler import RunScheduler

__all__ = [
    "BenchClient",
    "ClientOptions",
    "EndpointError",
    "PromptTextRenderer",
    "fetch_model_id",
    "sse_lines",
    "DEFAULT_BASE_URL",
    "ENDPOINT_PATHS",
    "PROMPT_FORMATS",
]

_MAX_ERROR_BODY_CHARS = 300
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of a Server-Sent Events body, split where SSE ends a line: at LF (a CR before
    it dropped). httpx's aiter_lines also splits at U+0085, U+2028, U+2029 and the other
    str.splitlines breaks, which JSON leaves unescaped inside a token's text (a model can emit
    them), so it would cut such a chunk in two."""
    rest = ""
    async for text in response.aiter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if rest:
        yield rest.removesuffix("\r")


class EndpointError(RuntimeError):
    """The server could not be asked at all (unreachable, or no model to benchmark)."""


async def fetch_model_id(http: httpx.AsyncClient) -> str:
    """The first model id that GET /v1/models lists."""
    try:
        response = await http.get("/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise EndpointError(f"cannot list models at {http.base_url}/v1/models: {exc}") from exc
    if not models:
        raise EndpointError(f"{http.base_url}/v1/models lists no models; pass --model")
    return str(models[0]["id"])


def _carries_token(choice: dict[str, Any], endpoint: str) -> bool:
    """Whether a streamed choice delivers output: an empty closing chunk (only finish_reason) or
    the chat role announcement does not."""
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content is None:
            return False
        return content != "" or ("role" not in delta and choice.get("finish_reason") is None)
    text = choice.get("text")
    if text is None:
        return False
    return text != "" or choice.get("finish_reason") is None


def token_id_to_word(token_id: int) -> str:
    """Base-70 syllable spelling of the id: distinct ids give distinct words."""
    if token_id < 0:
        raise ValueError(f"token ids must be >= 0, got {token_id}")
    syllables = []
    value = token_id
    while True:
        value, digit = divmod(value, len(_SYLLABLES))
        syllables.append(_SYLLABLES[digit])
        if value == 0:
            return "".join(reversed(syllables))


class PromptTextRenderer:
    """Token-id prompts as text, for servers or endpoints that need text (see the module doc)."""

    def __init__(self, tokenizer_path: str | Path | None = None) -> None:
        self._tokenizer = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer  # only needed when a tokenizer is given

            path = Path(tokenizer_path)
            if path.is_dir():
                path = path / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer.json at {tokenizer_path}")
            self._tokenizer = Tokenizer.from_file(str(path))

    def render(self, token_ids: Sequence[int]) -> str:
        if self._tokenizer is not None:
            return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)
        return " ".join(token_id_to_word(token_id) for token_id in token_ids)


class BenchClient:
    def __init__(self, options: ClientOptions, text_renderer: PromptTextRenderer | None = None) -> None:
        self.options = options
        self.text_renderer = text_renderer or PromptTextRenderer()

    def run(self, requests: list[BenchRequest], load: LoadPoint, config_name: str = "default") -> RunResult:
        return asyncio.run(self.run_async(requests, load, config_name))

    def build_payload(self, model: str, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.options.temperature,
        }
        if self.options.ignore_eos:
            body["ignore_eos"] = True
        if self.options.first_token_stages:
            body["return_first_token_stages"] = True  # in the usage chunk
        text = None
        if self.options.sends_text:
            text = request.prompt_text or self.text_renderer.render(request.prompt_token_ids)
        if self.options.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text if text is not None else list(request.prompt_token_ids)
        body.update(self.options.extra_body)
        return body

    def _http_client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else {}
        return httpx.AsyncClient(
            base_url=self.options.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(self.options.request_timeout_s, connect=self.options.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    async def run_async(self, requests: list[BenchRequest], load: LoadPoint, config_name: str = "default") -> RunResult:
        requests = list(requests)[: self.options.max_requests]
        async with self._http_client() as http:
            model = self.options.model or await fetch_model_id(http)
            await self.warm_up(http, model, requests)
            return await RunScheduler(self, http, model, requests, load).execute(config_name)

    async def warm_up(self, http: httpx.AsyncClient, model: str, requests: list[BenchRequest]) -> None:
        if not requests or self.options.num_warmup_requests == 0:
            return
        first_token = requests[0].prompt_token_ids[0]
        warmup = BenchRequest("warmup", (first_token,) * 4, max_tokens=2)
        await asyncio.gather(
            *(
                self.send(http, model, warmup, RequestRecord("warmup", 4, 2, 0.0), time.perf_counter)
                for _ in range(self.options.num_warmup_requests)
            )
        )

    async def send(
        self,
        http: httpx.AsyncClient,
        model: str,
        request: BenchRequest,
        record: RequestRecord,
        clock: Callable[[], float],
    ) -> None:
        """Stream one request into `record`; never raises except for cancellation."""
        payload = self.build_payload(model, request)
        record.send_time_s = clock()
        try:
            await asyncio.wait_for(self._exchange(http, payload, record, clock), self.options.request_timeout_s)
            if record.error is None and record.first_token_time_s is None:
                record.error = "no_tokens: the stream ended without an output token"
        except TimeoutError:
            record.error = f"timeout: no complete answer within {self.options.request_timeout_s:g}s"
        except asyncio.CancelledError:
            record.error = DEADLINE_ERROR
            raise
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end_time_s = clock()

    async def _exchange(
        self,
        http: httpx.AsyncClient,
        payload: dict[str, Any],
        record: RequestRecord,
        clock: Callable[[], float],
    ) -> None:
        async with http.stream("POST", ENDPOINT_PATHS[self.options.endpoint], json=payload) as response:
            record.status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"http_{response.status_code}: {body[:_MAX_ERROR_BODY_CHARS]}"
            else:
                await self._read_stream(response, record, clock)

    async def _read_stream(self, response: httpx.Response, record: RequestRecord, clock: Callable[[], float]) -> None:
        async for line in sse_lines(response):
            now = clock()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                record.error = f"bad_chunk: not JSON: {data[:_MAX_ERROR_BODY_CHARS]}"
                return
            if chunk.get("error"):
                record.error = f"stream_error: {json.dumps(chunk['error'])[:_MAX_ERROR_BODY_CHARS]}"
                return
            self._absorb_chunk(chunk, record, now)

    def _absorb_chunk(self, chunk: dict[str, Any], record: RequestRecord, now: float) -> None:
        usage = chunk.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
            record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                record.cached_tokens = int(details["cached_tokens"])
            stages = usage.get("first_token_stages")
            if stages:  # one per choice; the client asks for one
                record.first_token_stages = {str(stage): float(s) for stage, s in stages[0].items()}
        if any(_carries_token(choice, self.options.endpoint) for choice in chunk.get("choices") or []):
            if record.first_token_time_s is None:
                record.first_token_time_s = now
            record.chunk_times_s.append(now)
