"""Checks a request against the model before it touches the engine."""

from __future__ import annotations

from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams


def validate_prompt(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, max_cache_tokens: int
) -> None:
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    # The common case in C-speed passes; only a prompt that fails them (or holds int subclasses)
    # is walked token by token, for the offending id.
    ids = prompt_token_ids
    if not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        for tok in ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
                raise InvalidRequestError(f"prompt token id {tok!r} is outside the vocabulary [0, {vocab_size})")
    # Ids and top_k beyond the vocabulary mean nothing, and huge ones do not even fit the wire.
    for tok in params.stop_token_ids:
        if not 0 <= tok < vocab_size:
            raise InvalidRequestError(f"stop token id {tok!r} is outside the vocabulary [0, {vocab_size})")
    for tok in params.logit_bias:
        if not 0 <= tok < vocab_size:
            raise InvalidRequestError(f"logit_bias token id {tok!r} is outside the vocabulary [0, {vocab_size})")
    if params.top_k > vocab_size:
        raise InvalidRequestError(
            f"top_k must be at most the vocabulary size {vocab_size} (0 or -1 disables it), got {params.top_k}"
        )
    num = len(prompt_token_ids)
    if params.num_resumed_tokens >= num:
        raise InvalidRequestError(
            f"a continuation resumes {params.num_resumed_tokens} output tokens of a {num}-token prompt"
        )
    if num >= max_model_len:
        raise InvalidRequestError(f"the prompt has {num} tokens but the model's context is {max_model_len} tokens")
    if num + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the prompt ({num} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens"
        )
    if num + params.max_tokens > max_cache_tokens:
        raise InvalidRequestError(
            f"the request needs up to {num + params.max_tokens} tokens of KV cache but this "
            f"replica holds only {max_cache_tokens}"
        )
