"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]  # every generated token so far
    text: str  # every generated character so far (stop string cut)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Per token, with SamplingParams.top_logprobs: [(token id, logprob), ...], most likely first.
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs, once computed (every output has them): prompt token
    # i + 1's log-probability given the tokens before it, and its top alternatives if asked.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)  # each prompt token's rank (1: most likely)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    queue_seconds: float | None = None  # arrival -> first scheduled
