"""Turn the backend's StreamChunks into OpenAI responses: SSE chunks while streaming, one
JSON body otherwise. CompletionRenderer and ChatRenderer differ only in the choice shapes."""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from splitserve.cluster.frontend.openai.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)

if TYPE_CHECKING:  # kvtransfer's package import is heavy; only the type is needed here
    from splitserve.cluster.frontend.openai.tool_call_output import ToolCallOutput
    from splitserve.kvtransfer.handoff import StreamChunk

SSE_DONE = "data: [DONE]\n\n"
# JSON has no -inf/NaN; like vLLM, report an impossible token's log-probability as -9999.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def sse_event(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class ResponseRenderer(ABC):
    """Accumulates one request's chunks (text, logprobs, usage) and renders them."""

    def __init__(
        self, request_id: str, model: str, created: int, tokenizer, include_logprobs: bool, include_usage: bool
    ):
        self.request_id = request_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.include_logprobs = include_logprobs
        self.include_usage = include_usage
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_output_tokens = 0

    # ---- accumulation --------------------------------------------------------------------
    def observe(self, chunk: StreamChunk) -> None:
        self.text_parts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(finite_logprob(lp) for lp in chunk.logprobs)
        self.num_prompt_tokens = max(self.num_prompt_tokens, chunk.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        self.num_output_tokens = max(self.num_output_tokens, chunk.num_output_tokens, len(self.token_ids))
        if chunk.finished:
            self.finish_reason = chunk.finish_reason or "stop"

    def mark_unfinished(self) -> None:
        """The stream ended without a final chunk: report it as aborted."""
        if self.finish_reason is None:
            self.finish_reason = "abort"

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            total_tokens=self.num_prompt_tokens + self.num_output_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    # ---- streaming -----------------------------------------------------------------------
    def opening_events(self) -> list[str]:
        return []

    def chunk_events(self, chunk: StreamChunk) -> list[str]:
        """Observe a chunk and render it as zero or one SSE event."""
        num_logprobs_before = len(self.logprobs)
        self.observe(chunk)
        if not (chunk.text or chunk.token_ids or chunk.finished):
            return []
        new_logprobs = self.logprobs[num_logprobs_before:]
        finish = self.finish_reason if chunk.finished else None
        return [sse_event(self.render_chunk(chunk.text, chunk.token_ids, new_logprobs, finish))]

    def closing_events(self) -> list[str]:
        """After the last chunk: a finish chunk if none came, the usage chunk, [DONE]."""
        events = []
        if self.finish_reason is None:
            self.mark_unfinished()
            events.append(sse_event(self.render_chunk("", [], [], self.finish_reason)))
        if self.include_usage:
            events.append(sse_event(self.render_usage_chunk()))
        events.append(SSE_DONE)
        return events

    # ---- shapes (subclasses) -------------------------------------------------------------
    @abstractmethod
    def render_chunk(self, text: str, token_ids: list[int], logprobs: list[float], finish_reason: str | None) -> dict:
        """One streamed chunk in the endpoint's shape."""

    @abstractmethod
    def render_usage_chunk(self) -> dict:
        """The final usage-only chunk (stream_options.include_usage)."""

    @abstractmethod
    def render_response(self) -> dict:
        """The whole non-streaming response body."""


class CompletionRenderer(ResponseRenderer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offset = 0

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> CompletionLogprobs | None:
        if not self.include_logprobs:
            return None
        tokens = self.token_strings(token_ids)
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), text_offset=offsets)

    def render_chunk(self, text, token_ids, logprobs, finish_reason) -> dict:
        choice = CompletionChoice(text=text, logprobs=self._logprobs(token_ids, logprobs), finish_reason=finish_reason)
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[choice]
        ).model_dump(mode="json")

    def render_usage_chunk(self) -> dict:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=self.usage()
        ).model_dump(mode="json")

    def render_response(self) -> dict:
        self._text_offset = 0
        choice = CompletionChoice(
            text=self.text, logprobs=self._logprobs(self.token_ids, self.logprobs), finish_reason=self.finish_reason
        )
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
        ).model_dump(mode="json")


class ChatRenderer(ResponseRenderer):
    def __init__(self, *args, tool_output: ToolCallOutput | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_output = tool_output  # a tool-calling request: output read as tool_calls

    def chunk_events(self, chunk: StreamChunk) -> list[str]:
        if self.tool_output is None:
            return super().chunk_events(chunk)
        self.observe(chunk)
        deltas = self.tool_output.stream_deltas(chunk.text, self.text)
        finish = None
        if chunk.finished:
            final, finish = self.tool_output.final_deltas(self.text, self.finish_reason)
            deltas += final
            self.finish_reason = finish
        events = [sse_event(self._chunk([ChatChunkChoice(delta=d)])) for d in deltas]
        if chunk.finished:
            events.append(sse_event(self._chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=finish)])))
        return events

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> ChatChoiceLogprobs | None:
        if not self.include_logprobs:
            return None
        content = [
            ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))
            for token, logprob in zip(self.token_strings(token_ids), logprobs)
        ]
        return ChatChoiceLogprobs(content=content)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump(mode="json")

    def opening_events(self) -> list[str]:
        # OpenAI opens every chat stream with the assistant role and empty content.
        return [sse_event(self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]))]

    def render_chunk(self, text, token_ids, logprobs, finish_reason) -> dict:
        delta = ChatDelta(content=text if text or finish_reason is None else None)
        return self._chunk(
            [ChatChunkChoice(delta=delta, logprobs=self._logprobs(token_ids, logprobs), finish_reason=finish_reason)]
        )

    def render_usage_chunk(self) -> dict:
        return self._chunk([], usage=self.usage())

    def render_response(self) -> dict:
        content, tool_calls, finish_reason = self.text, None, self.finish_reason
        if self.tool_output is not None:
            content, tool_calls, finish_reason = self.tool_output.message(self.text, self.finish_reason)
        choice = ChatChoice(
            message=ChatMessage(content=content, tool_calls=tool_calls),
            logprobs=self._logprobs(self.token_ids, self.logprobs),
            finish_reason=finish_reason,
        )
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
        ).model_dump(mode="json")
