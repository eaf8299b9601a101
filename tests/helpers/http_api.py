"""A fake ServingBackend (real tokenizer, scripted generation) and an in-process uvicorn server
for the HTTP frontend tests. No Ray, no model."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.serving_api import ChoiceRequest, ServingAPI
from splitserve.cluster.request_error import ErrorKind, RequestError, invalid
from splitserve.engine.builtin_models.make_model import write_random_checkpoint
from splitserve.engine.io.request_validation import validate_prompt
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.structured_output.grammar_limits import check_limits, check_schema
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

MODEL_NAME = "tiny-test"
REPLY = "The quick brown fox."  # 13 tokens with the tiny tokenizer: under the default max_tokens


def static_constraint_check(cfg: ServeConfig, spec, field: str, parts=None) -> None:
    """The fakes' ServingBackend.check_constraint: the static bounds only (the real one adds
    the isolated compile)."""
    try:
        for name, schema in (parts or {}).items():
            check_schema(schema, cfg.grammar, name)
        if spec is not None:
            check_limits(spec, cfg.grammar)
    except InvalidRequestError as exc:
        raise invalid(f"{field}: {exc}", field) from None


class FakeBackend:
    """ServingBackend's interface. Generation replays REPLY one token per chunk, finishing
    with "stop" after the whole reply (unless ignore_eos) or "length" at max_tokens."""

    # What a real first chunk carries (cluster/frontend/first_token_stages.py), seconds.
    FIRST_TOKEN_STAGES = {"routing": 0.001, "prefill_compute": 0.004, "relay": 0.0005}

    def __init__(self, tokenizer, cfg: ServeConfig | None = None, max_model_len: int = 1024):
        self.cfg = cfg or ServeConfig()
        self.vocab_size = tokenizer.vocab_size
        self.model_name = MODEL_NAME
        self.ingress_id = "fake-ingress"
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self.metrics = Metrics(MODEL_NAME)
        self.healthy = True
        self.serving: bool | None = None  # None: health() omits it (an older backend)
        self.num_cached_tokens = 0
        self.refusal: RequestError | None = None  # raised before the first chunk
        self.crash: Exception | None = None  # an unexpected error before the first chunk
        self.fail_after: int | None = None  # raise RequestError after this many chunks
        self.hang_after: int | None = None  # wait "forever" after this many chunks
        self.token_interval_s = 0.0  # pause before each chunk (a slow, steady stream)
        self.calls: list[dict] = []
        self.closed_request_ids: list[str] = []  # generators closed before they finished
        self.closed_early = threading.Event()
        self.num_yielded = 0
        self.first_token_stages = dict(self.FIRST_TOKEN_STAGES)

    def encode(self, text: str) -> list[int]:
        if not text:
            raise invalid("the prompt is empty")
        return self.tokenizer.encode(text)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt=True,
        add_special_tokens=False,
    ) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            validate_prompt(prompt_token_ids, params, self.tokenizer.vocab_size, self.max_model_len, self.max_model_len)
        except InvalidRequestError as exc:
            raise invalid(str(exc)) from None

    async def check_constraint(self, spec, field: str, parts=None, deadline=None) -> None:
        static_constraint_check(self.cfg, spec, field, parts)

    def health(self) -> dict:
        state = {"ok": self.healthy, "decode_replicas": int(self.healthy)}
        if self.serving is not None:
            state["serving"] = self.serving
        return state

    async def render_metrics(self) -> bytes:
        return self.metrics.render()

    def generate(self, choice: ChoiceRequest):
        """The scripted chunks, metered for a tenant's request as the real backend's are."""
        return choice.metered(self._generate(choice))

    async def _generate(self, choice: ChoiceRequest):
        prompt_token_ids, params, label = choice.prompt_token_ids, choice.params, choice.label
        api_key, timeout_s, sheddable = choice.api_key, choice.timeout_s, choice.sheddable
        self.validate(prompt_token_ids, params)
        request_id = f"fake-{len(self.calls) + 1}"  # the server's own id; label is the client's
        self.calls.append(
            {
                "prompt_token_ids": list(prompt_token_ids),
                "params": params,
                "request_id": request_id,
                "label": label,
                "api_key": api_key,
                "timeout_s": timeout_s,
                "sheddable": sheddable,
            }
        )
        if self.refusal is not None:
            raise self.refusal
        if self.crash is not None:
            raise self.crash
        finished = False
        try:
            for n in range(1, params.max_tokens + 1):
                if self.hang_after is not None and n > self.hang_after:
                    await asyncio.sleep(3600)
                if self.fail_after is not None and n > self.fail_after:
                    raise RequestError(ErrorKind.UNAVAILABLE, "the decode replica died")
                await asyncio.sleep(self.token_interval_s)
                token = self.reply_ids[(n - 1) % len(self.reply_ids)]
                stop = n == len(self.reply_ids) and not params.ignore_eos
                finished = stop or n == params.max_tokens
                self.metrics.generation_tokens.inc()
                self.num_yielded += 1
                yield StreamChunk(
                    request_id=request_id,
                    token_ids=[token],
                    text=self.tokenizer.decode([token]),
                    finished=finished,
                    finish_reason=("stop" if stop else "length") if finished else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=min(self.num_cached_tokens, len(prompt_token_ids) - 1),
                    num_output_tokens=n,
                    logprobs=[-0.25 * n] if params.logprobs else [],
                    first_token_stages=self.first_token_stages if n == 1 else {},
                )
                if finished:
                    return
        finally:
            if not finished:
                self.closed_request_ids.append(request_id)
                self.closed_early.set()

    def expected_text(self, num_tokens: int) -> str:
        return "".join(self.tokenizer.decode([self.reply_ids[i % len(self.reply_ids)]]) for i in range(num_tokens))


def parse_sse(body: str) -> list[dict | str]:
    """The data payloads of an SSE body: dicts, and the final "[DONE]"."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1, an OS-chosen port, in a daemon thread."""

    def __init__(self, app, http="auto") -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10.0
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start within 10 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10.0)

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


def tiny_tokenizer(out_dir) -> Tokenizer:
    """The tokenizer of a `tiny` random checkpoint written into out_dir."""
    return Tokenizer.from_pretrained(write_random_checkpoint(out_dir, preset="tiny"))


def assert_error(resp, status: int, error_type: str = "invalid_request_error", param=None):
    """resp is an error in OpenAI's shape with this status and type (and param, when given), and
    no traceback; returns its `error` object."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def as_serving_api(backend: FakeBackend) -> ServingAPI:
    """FakeBackend is a ServingAPI: mypy checks this double against the frontends' protocol."""
    return backend
