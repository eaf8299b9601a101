"""Prompt-lookup guesses and the n-gram hit rate of an output."""

from __future__ import annotations

import pytest

from splitserve.bench.models.prompt_lookup import ngram_hit_rate, prompt_lookup_guess


def test_guess_follows_the_longest_most_recent_match():
    # Suffix [1, 2] occurred at 0 (followed by 3) and at 4 (followed by 9): the newest wins.
    assert prompt_lookup_guess([1, 2, 3, 7, 1, 2, 9, 5, 1, 2]) == 9
    # Suffix [5, 1, 2] beats the more recent 2-gram match: longer n first.
    assert prompt_lookup_guess([5, 1, 2, 8, 1, 2, 9, 5, 1, 2]) == 8
    # Only a 1-gram match: 4 followed 2 at position 1.
    assert prompt_lookup_guess([2, 4, 6, 2]) == 4
    assert prompt_lookup_guess([2, 4, 6, 2], min_n=2) is None
    assert prompt_lookup_guess([1, 2, 3]) is None
    assert prompt_lookup_guess([]) is None
    assert prompt_lookup_guess([7]) is None
    # Overlapping self-match: in 1 1 1 the suffix [1, 1] occurred at 0, followed by 1.
    assert prompt_lookup_guess([1, 1, 1]) == 1


def test_hit_rate_of_copying_and_of_fresh_output():
    quoted = list(range(10, 30))
    # Output that copies the prompt after its first token: every guess after a match hits.
    assert ngram_hit_rate(quoted + [10], quoted[1:]) == 1.0
    # Tokens never seen before: no guess can hit.
    assert ngram_hit_rate(quoted, list(range(100, 120))) == 0.0
    # Half the output repeats a phrase seen in the prompt.
    rate = ngram_hit_rate([1, 2, 3, 4], [1, 2, 3, 4, 50, 60, 70, 80])
    assert rate == pytest.approx(3 / 8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_n"):
        prompt_lookup_guess([1, 2], max_n=1, min_n=2)
    with pytest.raises(ValueError, match="min_n"):
        prompt_lookup_guess([1, 2], min_n=0)
    with pytest.raises(ValueError, match="empty"):
        ngram_hit_rate([1, 2], [])
