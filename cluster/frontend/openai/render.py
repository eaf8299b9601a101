"""Turn the backend's StreamChunks into OpenAI responses: SSE chunks while streaming, one
JSON body otherwise. A request has one choice per (prompt, n); CompletionRenderer
(completion_renderer.py) and ChatRenderer differ only in the choice shapes."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from json.encoder import encode_basestring
from typing import TYPE_CHECKING

from splitserve.cluster.frontend.openai.choice import MIN_LOGPROB, ChoiceState, finite_logprob
from splitserve.cluster.frontend.openai.prompt_logprobs import prompt_logprobs_field
from splitserve.cluster.frontend.openai.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    PromptTokensDetails,
    Usage,
)
from splitserve.cluster.frontend.openai.tool_call_output import ToolCallOutput

if TYPE_CHECKING:  # kvtransfer's package import is heavy; only the type is needed here
    from splitserve.cluster.frontend.openai.tools import ToolCallPlan
    from splitserve.proto.messages.handoff import StreamChunk

__all__ = ["MIN_LOGPROB", "SSE_DONE", "ChatRenderer", "ResponseRenderer", "finite_logprob"]
SSE_DONE = "data: [DONE]\n\n"
# json.dumps(x, ensure_ascii=False) builds a JSONEncoder (and its C encoder) on every call;
# one shared encoder gives the same bytes without that per-event cost.
JSON = json.JSONEncoder(ensure_ascii=False)
# Stands for a streamed chunk's text while its choice's template is rendered (see text_event).
_TEXT_MARK = "\x00splitserve-text\x00"


def sse_event(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else JSON.encode(payload)
    return f"data: {data}\n\n"


def chunk_envelope(request_id: str, object_name: str, created: int, model: str) -> str:
    """The constant head of every stream chunk of a request, up to the opening of its
    `choices` list: `data: {"id": ..., "object": ..., "created": ..., "model": ..., "choices": [`.
    Streamed chunks are this plus one choice and `]}`, the same bytes the chunk models dump
    to, without building and dumping a pydantic model per token (the relay's hot path)."""
    empty = JSON.encode({"id": request_id, "object": object_name, "created": created, "model": model, "choices": []})
    return "data: " + empty[: -len("]}")]


class ResponseRenderer(ABC):
    """Accumulates every choice's chunks (text, logprobs, usage) and renders them.

    prompt_lengths: the token count of each prompt; choice i belongs to prompt i // n.
    echoes: per prompt, the text to prepend to its choices (completions `echo`).
    prompt_logprobs_ids: per prompt, its token ids, when vLLM's prompt_logprobs field is asked for."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        tokenizer,
        include_logprobs: bool,
        include_usage: bool,
        prompt_lengths: list[int] | None = None,
        n: int = 1,
        echoes: list[str] | None = None,
        prompt_logprobs_ids: list[list[int]] | None = None,
        include_first_token_stages: bool = False,
    ):
        self.request_id = request_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.include_logprobs = include_logprobs
        self.include_usage = include_usage
        self.prompt_lengths = list(prompt_lengths or [0])
        echoes = echoes or [""] * len(self.prompt_lengths)
        self.choices = [ChoiceState(p * n + i, p, echoes[p]) for p in range(len(self.prompt_lengths)) for i in range(n)]
        self._envelope = chunk_envelope(request_id, self.chunk_object, created, model)
        # Per choice index: a text-only chunk's event up to its text and after it (text_event).
        self._text_templates: dict[int, tuple[str, str]] = {}
        self.prompt_logprobs_ids = prompt_logprobs_ids
        self.include_first_token_stages = include_first_token_stages

    def answered_by(self, model: str) -> None:
        """The served model that answers (an alias or virtual model picked it): the `model`
        of every chunk and of the response. Before the first event is rendered."""
        self.model = model
        self._envelope = chunk_envelope(self.request_id, self.chunk_object, self.created, model)
        self._text_templates.clear()

    # ---- accumulation --------------------------------------------------------------------
    def observe(self, chunk: StreamChunk, index: int = 0) -> None:
        self.choices[index].observe(chunk)

    def all_finished(self) -> bool:
        """Every choice has had its last chunk."""
        return all(choice.finish_reason is not None for choice in self.choices)

    def mark_unfinished(self) -> None:
        for choice in self.choices:
            choice.mark_unfinished()

    def usage(self) -> Usage:
        # Each prompt counts once, however many choices it has (as vLLM counts n > 1).
        num_prompt = sum(
            max([self.prompt_lengths[p]] + [c.num_prompt_tokens for c in self.choices if c.prompt_index == p])
            for p in range(len(self.prompt_lengths))
        )
        num_cached = sum(
            max([0] + [c.num_cached_tokens for c in self.choices if c.prompt_index == p])
            for p in range(len(self.prompt_lengths))
        )
        num_output = sum(c.num_output_tokens for c in self.choices)
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_output,
            total_tokens=num_prompt + num_output,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
            first_token_stages=[c.first_token_stages for c in self.choices]
            if self.include_first_token_stages
            else None,
        )

    def token_string(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_logprobs(self, choice: ChoiceState):
        """vLLM's prompt_logprobs field of choice, or None when not asked for (or none came)."""
        if self.prompt_logprobs_ids is None:
            return None
        return prompt_logprobs_field(choice, self.prompt_logprobs_ids[choice.prompt_index], self.token_string)

    # ---- streaming -----------------------------------------------------------------------
    def opening_events(self) -> list[str]:
        return []

    def chunk_events(self, chunk: StreamChunk, index: int = 0) -> list[str]:
        """Observe a chunk of choice `index` and render it as zero or one SSE event."""
        choice = self.choices[index]
        num_before = len(choice.token_ids)
        choice.observe(chunk)
        if not (chunk.text or chunk.token_ids or chunk.finished):
            return []
        finish = choice.finish_reason if chunk.finished else None
        return [self.chunk_event(choice, choice.take_echo() + choice.shown_text(chunk), num_before, finish)]

    def chunk_event(self, choice: ChoiceState, text: str, first_token: int, finish_reason: str | None) -> str:
        """The SSE event of one streamed chunk of `choice` (see render_choice)."""
        if finish_reason is None and not self.include_logprobs:
            return self.text_event(choice, text)
        rendered = JSON.encode(self.render_choice(choice, text, first_token, finish_reason))
        return f"{self._envelope}{rendered}]}}\n\n"

    def text_event(self, choice: ChoiceState, text: str) -> str:
        """A chunk of text alone (no log-probabilities, not the last): nearly every event of a
        stream. Its choice's event is rendered once with a marker for the text and split
        there; each chunk is then the two halves around its JSON-encoded text: the same bytes
        as chunk_event's full rendering, with one string encode per token instead of a dict
        and an encoder pass."""
        template = self._text_templates.get(choice.index)
        if template is None:
            rendered = JSON.encode(self.render_choice(choice, _TEXT_MARK, len(choice.token_ids), None))
            head, tail = rendered.split(encode_basestring(_TEXT_MARK))
            template = self._text_templates[choice.index] = (f"{self._envelope}{head}", f"{tail}]}}\n\n")
        return f"{template[0]}{encode_basestring(text)}{template[1]}"

    def closing_events(self) -> list[str]:
        """After the last chunk: a finish chunk for each choice that got none, the usage
        chunk, [DONE]."""
        events = []
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.mark_unfinished()
                num_tokens = len(choice.token_ids)
                events.append(self.chunk_event(choice, choice.take_echo(), num_tokens, choice.finish_reason))
        if self.include_usage:
            events.append(sse_event(self.render_usage_chunk()))
        events.append(SSE_DONE)
        return events

    # ---- shapes (subclasses) -------------------------------------------------------------
    chunk_object: str  # the `object` of a stream chunk

    @abstractmethod
    def render_choice(self, choice: ChoiceState, text: str, first_token: int, finish_reason: str | None) -> dict:
        """The one choice of a streamed chunk of `choice`, as JSON-ready dict: `text`, and its
        tokens from index first_token on. Its keys and values are what the chunk model's
        choice dumps to (tests/cluster/frontend/test_render.py holds them to it)."""

    @abstractmethod
    def render_usage_chunk(self) -> dict:
        """The final usage-only chunk (stream_options.include_usage)."""

    @abstractmethod
    def render_response(self) -> dict:
        """The whole non-streaming response body."""


class ChatRenderer(ResponseRenderer):
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tool_plan: ToolCallPlan | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # A tool-calling request: each choice's output is read back as tool_calls.
        self.tool_outputs = {} if tool_plan is None else {c.index: ToolCallOutput(tool_plan) for c in self.choices}

    def chunk_events(self, chunk: StreamChunk, index: int = 0) -> list[str]:
        tool_output = self.tool_outputs.get(index)
        if tool_output is None:
            return super().chunk_events(chunk, index)
        choice = self.choices[index]
        choice.observe(chunk)
        deltas = tool_output.stream_deltas(chunk.text, choice.text)
        finish = None
        if chunk.finished:
            final, finish = tool_output.final_deltas(choice.text, choice.finish_reason)
            deltas += final
            choice.finish_reason = finish
        events = [sse_event(self._chunk([ChatChunkChoice(index=index, delta=d)])) for d in deltas]
        if chunk.finished:
            done = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish)
            events.append(sse_event(self._chunk([done])))
        return events

    def _entry(self, token_id: int, logprob: float) -> ChatTopLogprob:
        token = self.token_string(token_id)
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    def _logprobs(self, choice: ChoiceState, start: int) -> ChatChoiceLogprobs | None:
        if not self.include_logprobs:
            return None
        tops = choice.top_logprobs[start:] or [[]] * len(choice.token_ids[start:])
        content = [
            ChatTokenLogprob(**self._entry(token_id, logprob).model_dump(), top_logprobs=[self._entry(*p) for p in top])
            for token_id, logprob, top in zip(choice.token_ids[start:], choice.logprobs[start:], tops)
        ]
        return ChatChoiceLogprobs(content=content)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump(mode="json")

    def opening_events(self) -> list[str]:
        # OpenAI opens every chat stream with the assistant role and empty content, per choice.
        return [
            sse_event(self._chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))]))
            for c in self.choices
        ]

    def render_choice(self, choice, text, first_token, finish_reason) -> dict:
        logprobs = self._logprobs(choice, first_token)
        return {
            "index": choice.index,
            # The finish chunk carries no content key unless it brings text (ChatDelta omits None).
            "delta": {"content": text} if text or finish_reason is None else {},
            "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason if finish_reason else None,
        }

    def render_usage_chunk(self) -> dict:
        return self._chunk([], usage=self.usage())

    def render_response(self) -> dict:
        choices = []
        for c in self.choices:
            content, tool_calls, finish_reason = c.text, None, c.finish_reason
            tool_output = self.tool_outputs.get(c.index)
            if tool_output is not None:
                content, tool_calls, finish_reason = tool_output.message(c.text, c.finish_reason)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatMessage(content=content, tool_calls=tool_calls),
                    logprobs=self._logprobs(c, 0),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(),
            prompt_logprobs=self.prompt_logprobs(self.choices[0]),  # one prompt, top level as vLLM's
        ).model_dump(mode="json")
