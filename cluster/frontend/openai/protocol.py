"""OpenAI-compatible request shapes for /v1/completions and /v1/chat/completions, and the
SamplingParams they ask for (responses: splitserve.cluster.frontend.openai.responses).

Requests ignore fields they know nothing about (OpenAI clients send some) but reject wrong
types (strict mode: no "0.5" for a float, no true for an int). Every parameter that is
accepted acts: what splitserve cannot honour (unsupported.py: beam search, min_p, ...) is
refused with a 400 that names the parameter and says why. Structured output and tool calling:
openai/structured_output.py and openai/tools.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from splitserve.cluster.frontend.openai.structured_output import ResponseFormat, StructuredOutputs, grammar_spec_for
from splitserve.cluster.frontend.openai.tools import ToolChoice, ToolParam, plan_tool_calls
from splitserve.cluster.frontend.openai.unsupported import refused_parameter
from splitserve.proto.messages.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    InvalidRequestError,
    SamplingParams,
)

SEED_RANGE = 2**63  # SamplingParams' seeds are in [0, 2**63)
MAX_N = 128  # OpenAI's limit on n
MAX_CHOICES = 128  # prompts x n in one completions request


class RequestParamError(InvalidRequestError):
    """A request parameter splitserve cannot honour; `param` names it for the error body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _only(default, *allowed, description: str):
    """A parameter accepted with one value only: /openapi.json lists the accepted values,
    check_supported() refuses the others with a message that says why."""
    return Field(default, description=description, json_schema_extra={"enum": list(allowed)})


def _integral_float_to_int(value):
    # JSON has one number type: 16.0 is a valid integer to JSON Schema (and to schemathesis).
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Integers that also accept 16.0 but, being strict otherwise, refuse 16.5, "16" and true.
# (Bounds go before the validator, or /openapi.json shows "ge" instead of "minimum".)
JsonInt = Annotated[int, BeforeValidator(_integral_float_to_int)]
# The markers let /openapi.json state the served vocabulary's bound (http/openapi_bounds.py).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True}), BeforeValidator(_integral_float_to_int)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral_float_to_int)]
TopK = Annotated[int, Field(ge=-1, json_schema_extra={"x-vocab-bound": True}), BeforeValidator(_integral_float_to_int)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    # Unknown fields are kept (not validated) so check_supported() can refuse the ones
    # splitserve knows it does not implement.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = Field(None, description="vLLM extension: 0 or -1 disables top-k")
    seed: JsonInt | None = Field(None, description="any integer; reduced modulo 2**63; choice i uses seed + i")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(
        None, description="vLLM extension: the text of the stop token is left out of the output"
    )
    n: Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integral_float_to_int)] = 1
    priority: JsonInt | None = Field(
        None,
        description="vLLM extension: lower runs first (a 32-bit integer); unset: the default of the request's "
        "priority class (header x-splitserve-priority-class: interactive or batch)",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        None, gt=0, description="vLLM extension: > 1 discourages tokens of the prompt and the output"
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description="token id (as a string) -> bias in [-100, 100] added to its logit; -100 bans it",
        json_schema_extra={"maxProperties": MAX_LOGIT_BIAS_ENTRIES},
    )
    min_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral_float_to_int)] | None = Field(
        None, description="vLLM extension: EOS and stop tokens are held off until this many tokens"
    )
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the stop string in the text")
    speculative_decoding: bool = Field(
        True, description="splitserve extension: false opts this request out of speculative decoding"
    )
    migration: bool = Field(
        True,
        description="splitserve extension: false ends this stream with an error when its decode replica fails "
        "mid-stream, instead of moving it to another replica",
    )
    return_first_token_stages: bool = Field(
        False,
        description="splitserve extension: the usage reports each choice's first-token stages (seconds: ingress, "
        "routing, prefill_queue, prefill_compute, handoff, decode_admission, relay), the observations "
        "/metrics' splitserve_first_token_stage_seconds got from this request; with stream, in the usage chunk "
        "(stream_options.include_usage)",
    )
    user: str | None = None
    prompt_logprobs: (
        Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral_float_to_int)] | None
    ) = Field(
        None,
        description="vLLM extension: each prompt token's log-probability and rank, with this many alternatives, "
        "in the response's prompt_logprobs (not with stream)",
    )
    # Structured output (openai/structured_output.py): OpenAI's field and vLLM's.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM extension: one of json, regex, choice, grammar, json_object"
    )
    guided_json: dict | str | None = Field(None, description="vLLM extension: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM extension")
    guided_choice: list[str] | None = Field(None, description="vLLM extension")
    guided_grammar: str | None = Field(None, description="vLLM extension: Lark or GBNF")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        refused = refused_parameter(self.model_extra or {})
        if refused is not None:
            name, message = refused
            raise RequestParamError(message, name)
        if self.prompt_logprobs is not None and self.stream:  # vLLM refuses it too
            raise RequestParamError("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.return_first_token_stages and self.stream and not self.include_usage:
            raise RequestParamError(
                "return_first_token_stages with stream needs stream_options.include_usage: the stages come in the "
                "usage chunk",
                "return_first_token_stages",
            )


class CompletionRequest(_SamplingRequest):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | TokenIds
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
    ) = Field(description="text, token ids, or a list of prompts (one choice per prompt and n)")
    max_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral_float_to_int)] | None = Field(
        16, description="0 only with echo: the prompt alone (with logprobs, its log-probabilities), as vLLM's"
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral_float_to_int)] | None = Field(
        None, description="the chosen token's log-probability and this many most likely alternatives"
    )
    echo: bool = Field(
        False,
        description="prepend the prompt to the completion text; with logprobs, also the prompt's log-probabilities",
    )
    best_of: JsonInt | None = Field(None, description="only 1 (or n) is supported: every choice is returned")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_prompt(cls, value):
        # Checked before the union so a mixed list gets this message, not four others.
        if isinstance(value, list) and len(value) > 1:
            kinds = {_prompt_item_kind(v) for v in value}
            if len(kinds) > 1 and not kinds <= {"token id"}:
                raise ValueError("prompt must be a string, a list of token ids, or a list of such prompts")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1, self.n):
            raise RequestParamError("best_of must be 1 or equal to n: every generated choice is returned", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise RequestParamError("max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise RequestParamError(f"prompts x n must be at most {MAX_CHOICES}", "n")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the response holds the prompt alone (vLLM's echo without
        generation). One token is still generated (the engine's minimum), and not shown."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of this request: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]


def _prompt_item_kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "token id"
    return {str: "text", list: "token ids"}.get(type(value), type(value).__name__)


class ContentPart(_Request):
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value):
        # Before the field checks, so an image part is refused for what it is.
        if isinstance(value, dict) and value.get("type") != "text":
            raise ValueError(f"only text content parts are supported, got a {value.get('type')!r} part")
        return value


class ChatMessageParam(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls, for the chat template
    tool_call_id: str | None = None  # a tool turn's answer to that call

    def to_template_dict(self) -> dict:
        """The message as the chat template sees it: content flattened to one string."""
        content = self.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            text = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": text}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = Field(None, description="takes precedence over max_tokens")
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral_float_to_int)] | None = (
        Field(None, description="with logprobs: this many most likely alternatives per token")
    )
    tools: list[ToolParam] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise RequestParamError("top_logprobs needs logprobs set to true", "top_logprobs")

    def template_messages(self) -> list[dict]:
        return [m.to_template_dict() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates expect them (OpenAI's shape)."""
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_call_plan(self):
        return plan_tool_calls(self.tools, self.tool_choice, self.parallel_tool_calls)


def build_sampling_params(
    request: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """SamplingParams for a request's first choice; raises InvalidRequestError (-> 400) for
    bad values. Chat requests without a token limit may use the rest of the context, as
    OpenAI's do."""
    request.check_supported()
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(max_model_len - num_prompt_tokens, 1)
        logprobs, top_logprobs = request.logprobs, (request.top_logprobs or 0) if request.logprobs else 0
    else:
        max_tokens = 16 if request.max_tokens is None else max(request.max_tokens, 1)  # 0: echo_only
        logprobs, top_logprobs = request.logprobs is not None, request.logprobs or 0
    # Completions echo with logprobs: the prompt's tokens get theirs too (as vLLM's and OpenAI's).
    echo_logprobs = isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None
    plan = request.tool_call_plan() if isinstance(request, ChatCompletionRequest) else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k is None else request.top_k,
        seed=None if request.seed is None else request.seed % SEED_RANGE,
        stop=[] if request.stop is None else request.stop,
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=request.logprobs
        if request.prompt_logprobs is None and echo_logprobs
        else request.prompt_logprobs,
        include_stop_str_in_output=request.include_stop_str_in_output,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=request.logit_bias or {},
        min_tokens=request.min_tokens or 0,
        speculative_decoding=request.speculative_decoding,
        migration=request.migration,
        structured_output=grammar_spec_for(request, None if plan is None else plan.grammar),
    )


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice `index` (of n): seed + index, as vLLM's parallel sampling
    does, so every choice is reproducible on its own and seeded choices differ."""
    if params.seed is None or index == 0:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + index) % SEED_RANGE)
