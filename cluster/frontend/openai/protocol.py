"""OpenAI-compatible request shapes for /v1/completions and /v1/chat/completions, and the
SamplingParams they ask for (responses: splitserve.cluster.frontend.openai.responses).

Requests ignore fields they do not know (OpenAI clients send some) but reject wrong types
(strict mode: no "0.5" for a float, no true for an int). Parameters splitserve cannot honour
(n > 1, echo, penalties, top alternatives in logprobs) are refused with a 400 that
names the parameter rather than silently ignored. Structured output and tool calling:
openai/structured_output.py and openai/tools.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from splitserve.cluster.frontend.openai.structured_output import ResponseFormat, StructuredOutputs, grammar_spec_for
from splitserve.cluster.frontend.openai.tools import ToolChoice, ToolParam, plan_tool_calls
from splitserve.engine.io.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    InvalidRequestError,
    SamplingParams,
)

SEED_RANGE = 2**63  # SamplingParams' seeds are in [0, 2**63)


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
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_integral_float_to_int)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral_float_to_int)]
TopK = Annotated[int, Field(ge=-1), BeforeValidator(_integral_float_to_int)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = Field(None, description="splitserve extension: 0 or -1 disables top-k")
    seed: JsonInt | None = Field(None, description="any integer; reduced modulo 2**63")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="splitserve extension")
    n: JsonInt = _only(1, 1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="splitserve extension: keep generating past EOS")
    presence_penalty: float | None = _only(None, 0, None, description="only 0 is supported")
    frequency_penalty: float | None = _only(None, 0, None, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(
        None, description="only an empty map is supported", json_schema_extra={"maxProperties": 0}
    )
    user: str | None = None
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
        if self.n != 1:
            raise RequestParamError("only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise RequestParamError(f"{name} is not supported; send 0 or omit it", name)
        if self.logit_bias:
            raise RequestParamError("logit_bias is not supported", "logit_bias")


class CompletionRequest(_SamplingRequest):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | TokenIds
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    ) = Field(description="one prompt: text, token ids, or a list holding one of those")
    max_tokens: PositiveInt | None = 16
    logprobs: JsonInt | None = _only(
        None, 0, None, description="0: the chosen token's log-probability, without alternatives"
    )
    echo: bool = _only(False, False, description="only false is supported")
    best_of: JsonInt | None = _only(None, 1, None, description="only 1 is supported")
    suffix: str | None = Field(None, description="not supported", json_schema_extra={"maxLength": 0})

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        # Checked before the union so a batch of prompts gets this message, not four others.
        if isinstance(value, list) and len(value) > 1:
            kinds = {_prompt_item_kind(v) for v in value}
            if kinds <= {"text", "token ids"}:
                raise ValueError("only one prompt per request is supported")
            if len(kinds) > 1:
                raise ValueError("prompt must be a string, a list of token ids, or a list holding one prompt")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise RequestParamError("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise RequestParamError("only best_of=1 is supported", "best_of")
        if self.suffix:
            raise RequestParamError("suffix is not supported", "suffix")
        if self.logprobs not in (None, 0):
            raise RequestParamError(
                "only logprobs=0 is supported: the chosen token's log-probability, without top alternatives", "logprobs"
            )

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: text or token ids (validation allows only one)."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            return prompt[0]
        return prompt


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
    top_logprobs: JsonInt | None = _only(None, 0, None, description="only 0 is supported")
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise RequestParamError(
                "only top_logprobs=0 is supported: the chosen token's log-probability, without top alternatives",
                "top_logprobs",
            )

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
    """SamplingParams for a request; raises InvalidRequestError (-> 400) for bad values.

    Chat requests without a token limit may use the rest of the context, as OpenAI's do.
    """
    request.check_supported()
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(max_model_len - num_prompt_tokens, 1)
        logprobs = request.logprobs
    else:
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        logprobs = request.logprobs is not None
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
        structured_output=grammar_spec_for(request, None if plan is None else plan.grammar),
    )
