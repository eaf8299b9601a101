"""Prompt lookup (n-gram) next-token guesses, and how often greedy output agrees with them.

The guess for the next token: find the most recent earlier occurrence of the longest suffix
of the tokens so far (n from max_n down to min_n), and take the token that followed it. This
is what an n-gram speculative proposer offers for its first position; the hit rate of a
model's own greedy output against it says how much such a proposer could be accepted.
Pure Python, no torch: the engine's scheduler side may reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence


def prompt_lookup_guess(tokens: Sequence[int], max_n: int = 3, min_n: int = 1) -> int | None:
    """The token that followed the most recent earlier match of the longest suffix of tokens
    (length max_n down to min_n); None when no suffix of those lengths occurred before."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # Start positions of earlier occurrences end before the suffix itself; newest first.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n]
    return None


def ngram_hit_rate(prompt: Sequence[int], output: Sequence[int], max_n: int = 3, min_n: int = 1) -> float:
    """Fraction of output tokens equal to prompt_lookup_guess(prompt + output[:i]).

    A position with no match counts as a miss (the proposer would propose nothing).
    """
    if not output:
        raise ValueError("output is empty")
    context = list(prompt)
    hits = 0
    for token in output:
        hits += prompt_lookup_guess(context, max_n, min_n) == token
        context.append(token)
    return hits / len(output)
