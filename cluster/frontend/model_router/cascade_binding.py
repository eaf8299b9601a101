"""CascadeBinding: one request under a cascade. The small model answers first, with token
log-probabilities asked for internally; its first `window_tokens` tokens are held back (never
streamed) until the decision. Confidence = the geometric mean of their probabilities
(exp of the mean log-probability). Below the threshold: the small request is aborted (closing
its stream frees its KV blocks) and the large model answers with the client's own params,
from its first token; so a streaming client never sees text that is later replaced. Else the
held tokens go out as one chunk and the small model streams on. The log-probabilities are
stripped from what the client gets unless it asked for them."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import msgspec

from splitserve.cluster.frontend.model_router.model_route_decision import ModelRouteDecision
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.serving_api import ChoiceRequest, GenerationAPI
from splitserve.proto.messages.handoff import StreamChunk


def confidence_of(logprobs: list[float], window_tokens: int) -> float:
    """exp(mean log-probability) of the first window_tokens tokens: 1.0 for no tokens (the
    small model ended at once: nothing to doubt)."""
    window = logprobs[:window_tokens]
    return math.exp(sum(window) / len(window)) if window else 1.0


class CascadeBinding:
    def __init__(
        self,
        route: str,
        small: tuple[str, GenerationAPI],
        large: tuple[str, GenerationAPI],
        window_tokens: int,
        threshold: float,
        metrics: ModelRouteMetrics,
    ):
        self.route = route
        (self.small_name, self.small), (self.large_name, self.large) = small, large
        self.window_tokens, self.threshold = window_tokens, threshold
        self.metrics = metrics
        self.decision: ModelRouteDecision | None = None  # set before the first chunk is yielded

    def generate(self, choice: ChoiceRequest) -> AsyncIterator[StreamChunk]:
        return choice.metered(self._cascade(choice.unmetered()))

    async def _cascade(self, choice: ChoiceRequest) -> AsyncIterator[StreamChunk]:
        params, label = choice.params, choice.label
        client_logprobs = params.logprobs
        small_params = params if client_logprobs else msgspec.structs.replace(params, logprobs=True)
        small = self.small.generate(choice.with_params(small_params))
        try:
            held: StreamChunk | None = None
            async for chunk in small:
                held = chunk if held is None else held.followed_by(chunk)
                if held.finished or len(held.logprobs) >= self.window_tokens:
                    break
            confidence = confidence_of(held.logprobs if held is not None else [], self.window_tokens)
            if confidence < self.threshold:
                await _close(small)  # aborts the small request; its KV blocks are freed
                self._decide(self.large_name, "escalated", confidence, label)
                large = self.large.generate(choice)
                try:
                    async for chunk in large:
                        yield chunk
                finally:
                    await _close(large)
                return
            self._decide(self.small_name, "confident", confidence, label)
            if held is not None:
                yield held if client_logprobs else _without_logprobs(held)
            async for chunk in small:
                yield chunk if client_logprobs else _without_logprobs(chunk)
        finally:
            await _close(small)

    def _decide(self, target: str, reason: str, confidence: float, label: str | None) -> None:
        self.decision = ModelRouteDecision(self.route, target, reason, confidence)
        self.metrics.record(self.decision, label)


async def _close(stream: AsyncIterator[StreamChunk]) -> None:
    """Close a generation's stream (its generator's cleanup aborts the request)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


def _without_logprobs(chunk: StreamChunk) -> StreamChunk:
    return msgspec.structs.replace(chunk, logprobs=[], top_logprobs=[])
