"""A fake ServingBackend and a GrpcFrontend running on its own event-loop thread, for tests
that talk to the server with ordinary (sync) grpc clients."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import grpc

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.grpc.server import GrpcFrontend
from splitserve.cluster.frontend.serving_api import ChoiceRequest, GenerationAPI
from splitserve.cluster.request_error import invalid
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.http_api import static_constraint_check

FAKE_MODEL_NAME = "tiny-fake"
FAKE_MAX_MODEL_LEN = 64
FAKE_CACHED_TOKENS = 2
FAKE_LOGPROB = -0.5


def fake_top_logprobs(token: int, k: int) -> list[tuple[int, float]]:
    """FakeBackend's alternatives at a position: the chosen token first, then the next ids,
    each 1 less likely."""
    return [(token + j, FAKE_LOGPROB - j) for j in range(k)]


class FakeBackend:
    """The ServingBackend interface the frontends use. generate() echoes the prompt's tokens
    cyclically, one token per chunk (with fake_top_logprobs when asked); knobs make it refuse,
    fail mid-stream or go slowly."""

    def __init__(self, tokenizer, cfg: ServeConfig):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.model_name = FAKE_MODEL_NAME
        self.ingress_id = "fake-ingress"
        self.max_model_len = FAKE_MAX_MODEL_LEN
        self.reset()

    async def check_constraint(self, spec, field: str, parts=None, deadline=None) -> None:
        static_constraint_check(self.cfg, spec, field, parts)

    def reset(self) -> None:
        self.healthy: bool | Exception = True  # an Exception: health() raises it
        self.refusal: Exception | None = None  # raised before the first chunk
        self.mid_stream_failure: Exception | None = None  # raised after the first chunk
        self.chunk_delay_s = 0.0
        self.calls: list[tuple[list[int], SamplingParams, str | None, str | None]] = []
        self.sheddable: list[bool] = []  # per call: was it batch (sheddable) work
        self.outcomes: list[str] = []  # per finished stream: completed | GeneratorExit | ...
        self.stream_ended = threading.Event()  # set from the server's loop thread

    def encode(self, text: str) -> list[int]:
        if not text:
            raise invalid("the prompt is empty")
        return self.tokenizer.encode(text)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise invalid(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the context length {self.max_model_len}"
            )
        if max(prompt_token_ids) >= self.tokenizer.vocab_size:
            raise invalid("token id out of range")

    def health(self) -> dict:
        if isinstance(self.healthy, Exception):
            raise self.healthy
        return {"ok": self.healthy, "decode_replicas": int(self.healthy)}

    def generate(self, choice: ChoiceRequest):
        return choice.metered(self._generate(choice))

    async def _generate(self, choice: ChoiceRequest):
        prompt_token_ids, params, label, api_key = choice.prompt_token_ids, choice.params, choice.label, choice.api_key
        sheddable = choice.sheddable
        self.validate(prompt_token_ids, params)
        if self.refusal is not None:
            raise self.refusal
        self.calls.append((list(prompt_token_ids), params, label, api_key))
        self.sheddable.append(sheddable)
        request_id = f"fake-{len(self.calls)}"  # the server's own id; label is the client's
        try:
            for i in range(params.max_tokens):
                if i and self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                if i == 1 and self.mid_stream_failure is not None:
                    raise self.mid_stream_failure
                token = prompt_token_ids[i % len(prompt_token_ids)]
                finished = i == params.max_tokens - 1
                yield StreamChunk(
                    request_id=request_id,
                    token_ids=[token],
                    text=self.tokenizer.decode([token]),
                    finished=finished,
                    finish_reason="length" if finished else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=FAKE_CACHED_TOKENS,
                    num_output_tokens=i + 1,
                    logprobs=[FAKE_LOGPROB] if params.logprobs else [],
                    top_logprobs=[fake_top_logprobs(token, params.top_logprobs)] if params.top_logprobs else [],
                )
        except BaseException as exc:
            self.outcomes.append(type(exc).__name__)
            raise
        else:
            self.outcomes.append("completed")
        finally:
            self.stream_ended.set()


class FrontendThread:
    """GrpcFrontend serving from a private event loop on a daemon thread."""

    def __init__(self, backend, health_poll_interval_s: float = 0.1):
        self.frontend = GrpcFrontend(backend, health_poll_interval_s=health_poll_interval_s)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-frontend", daemon=True)
        self._thread.start()
        self.port: int | None = None

    def call(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.port = self.call(self.frontend.start(host, port))
        return self.port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self, grace_s: float = 0.5) -> None:
        self.call(self.frontend.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@contextlib.contextmanager
def serving_frontend(backend) -> Iterator[tuple[FrontendThread, grpc.Channel]]:
    """A FrontendThread serving `backend` and a client channel to it; both closed after."""
    server = FrontendThread(backend)
    server.start()
    channel = grpc.insecure_channel(server.target)
    try:
        yield server, channel
    finally:
        channel.close()
        server.close()


def as_generation_api(backend: FakeBackend) -> GenerationAPI:
    """FakeBackend is a GenerationAPI: mypy checks this double against the frontends' protocol."""
    return backend
