"""OpenAI-compatible response shapes: completions, chat completions, their stream chunks,
usage (with prompt_tokens_details.cached_tokens), the model list and the error body."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


def _omit_if_none(value) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    first_token_stages: list[dict[str, float]] | None = Field(
        None,
        exclude_if=_omit_if_none,
        description="splitserve extension, with the request's return_first_token_stages: per choice, stage -> "
        "seconds (as /metrics' splitserve_first_token_stage_seconds observed them); {} for a choice that got no token",
    )


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    # None for the first prompt token when the prompt is echoed with its log-probabilities.
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token of a prompt position in the `prompt_logprobs` field."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position: None for the first token, then token id (a string in JSON) -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM: the stop token id or stop string that ended it")
    prompt_logprobs: PromptLogprobs | None = Field(
        None, exclude_if=_omit_if_none, description="vLLM: with the prompt_logprobs request field"
    )


class CompletionResponse(BaseModel):
    """A completion, and (object "text_completion" too) each chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_omit_if_none)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, exclude_if=_omit_if_none)
    arguments: str | None = Field(None, exclude_if=_omit_if_none)


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = Field(None, exclude_if=_omit_if_none)
    type: Literal["function"] | None = Field(None, exclude_if=_omit_if_none)
    function: FunctionCallDelta


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_omit_if_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM: the stop token id or stop string that ended it")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(
        None, exclude_if=_omit_if_none, description="vLLM: with the prompt_logprobs request field"
    )


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_if_none)
    content: str | None = Field(None, exclude_if=_omit_if_none)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_omit_if_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_omit_if_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitserve"
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for a model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, error_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code)).model_dump()
