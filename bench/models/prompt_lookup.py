"""How often a model's greedy output agrees with prompt-lookup (n-gram) guesses.

The guess for the next token is the n-gram proposer's first draft token
(engine/speculative/ngram_proposer.py); the hit rate of a model's own greedy output against it says
how much such a proposer could be accepted. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.engine.speculative.ngram_proposer import NgramProposer


def prompt_lookup_guess(tokens: Sequence[int], max_n: int = 3, min_n: int = 1) -> int | None:
    """The token that followed the most recent earlier match of the longest suffix of tokens
    (length max_n down to min_n); None when no suffix of those lengths occurred before."""
    draft = NgramProposer(min_n, max_n).propose(list(tokens), 1)
    return draft[0] if draft else None


def ngram_hit_rate(prompt: Sequence[int], output: Sequence[int], max_n: int = 3, min_n: int = 1) -> float:
    """Fraction of output tokens equal to prompt_lookup_guess(prompt + output[:i]).

    A position with no match counts as a miss (the proposer would propose nothing).
    """
    if not output:
        raise ValueError("output is empty")
    proposer = NgramProposer(min_n, max_n)
    context = list(prompt)
    hits = 0
    for token in output:
        draft = proposer.propose(context, 1)
        hits += bool(draft) and draft[0] == token
        context.append(token)
    return hits / len(output)
