"""One choice of an OpenAI response as its chunks arrive: text, tokens, log-probabilities
(with the top alternatives), finish and stop reason."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kvtransfer's package import is heavy; only the type is needed here
    from splitserve.proto.messages.handoff import StreamChunk

# JSON has no -inf/NaN; like vLLM, report an impossible token's log-probability as -9999.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


class ChoiceState:
    """Accumulates the chunks of choice `index`, generated for prompt `prompt_index`."""

    def __init__(self, index: int, prompt_index: int, echo: str = ""):
        self.index = index
        self.prompt_index = prompt_index
        self.echo = echo  # the prompt's text, sent before the completion (completions `echo`)
        self.echo_sent = False
        self.echo_only = False  # completions echo with max_tokens 0: the generated token is not shown
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        # Echo with logprobs: prompt token i + 1's log-probability (and alternatives), from the first chunk.
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_ranks: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        # The first chunk's stages (cluster/frontend/first_token_stages.py); a chunk after a
        # migration carries none and does not replace them.
        self.first_token_stages: dict[str, float] = {}

    def observe(self, chunk: StreamChunk) -> None:
        if not self.echo_only:
            self.text_parts.append(chunk.text)
            self.token_ids.extend(chunk.token_ids)
            if chunk.logprobs:  # once per token: no generator built for the usual empty list
                self.logprobs.extend(finite_logprob(lp) for lp in chunk.logprobs)
            if chunk.top_logprobs:
                self.top_logprobs.extend([(int(t), finite_logprob(lp)) for t, lp in top] for top in chunk.top_logprobs)
        if chunk.prompt_logprobs:
            self.prompt_logprobs.extend(finite_logprob(lp) for lp in chunk.prompt_logprobs)
            self.prompt_top_logprobs.extend(
                [(int(t), finite_logprob(lp)) for t, lp in top] for top in chunk.prompt_top_logprobs
            )
            self.prompt_ranks.extend(chunk.prompt_ranks)
        if chunk.first_token_stages and not self.first_token_stages:
            self.first_token_stages = dict(chunk.first_token_stages)
        self.num_prompt_tokens = max(self.num_prompt_tokens, chunk.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        self.num_output_tokens = max(self.num_output_tokens, chunk.num_output_tokens, len(self.token_ids))
        if chunk.finished:
            # echo_only asked for no tokens and got none: its limit ended it, whatever the hidden token.
            self.finish_reason = "length" if self.echo_only else chunk.finish_reason or "stop"
            self.stop_reason = chunk.stop_reason

    def shown_text(self, chunk: StreamChunk) -> str:
        """The part of chunk's text the client sees (none of it when echo_only)."""
        return "" if self.echo_only else chunk.text

    def mark_unfinished(self) -> None:
        """The stream ended without a final chunk: report it as aborted."""
        if self.finish_reason is None:
            self.finish_reason = "abort"

    @property
    def text(self) -> str:
        return self.echo + "".join(self.text_parts)

    def take_echo(self) -> str:
        """The echoed prompt, once: streaming sends it ahead of the first generated text."""
        if self.echo_sent:
            return ""
        self.echo_sent = True
        return self.echo
