"""vLLM's `prompt_logprobs` response field (the request field of the same name, completions and
chat): per prompt position null for the first token, then {token id: {logprob, rank,
decoded_token}} with the prompt token's entry first and the most likely alternatives after it
(ranks 1, 2, ...), as vLLM's Logprob dicts. Not streamed (vLLM refuses it with stream too)."""

from __future__ import annotations

from collections.abc import Callable

from splitserve.cluster.frontend.openai.choice import ChoiceState
from splitserve.cluster.frontend.openai.responses import PromptLogprob


def prompt_logprobs_field(
    choice: ChoiceState, prompt: list[int], token_string: Callable[[int], str]
) -> list[dict[str, PromptLogprob] | None] | None:
    """The field for one choice of prompt `prompt`; None if its log-probabilities never came."""
    if len(choice.prompt_logprobs) != len(prompt) - 1 or len(choice.prompt_ranks) != len(prompt) - 1:
        return None
    field: list[dict[str, PromptLogprob] | None] = [None]
    for i, token in enumerate(prompt[1:]):
        entry = {
            str(token): PromptLogprob(
                logprob=choice.prompt_logprobs[i], rank=choice.prompt_ranks[i], decoded_token=token_string(token)
            )
        }
        alternatives = choice.prompt_top_logprobs[i] if choice.prompt_top_logprobs else []
        for rank, (alt, logprob) in enumerate(alternatives, start=1):
            entry.setdefault(str(alt), PromptLogprob(logprob=logprob, rank=rank, decoded_token=token_string(alt)))
        field.append(entry)
    return field
