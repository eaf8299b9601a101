"""NgramProposer: prompt-lookup drafts (Saxena 2023; vLLM's and SGLang's "ngram" method).

The draft for a sequence: find the most recent earlier occurrence of the longest suffix of its
tokens (prompt + output so far; suffix lengths max_n down to min_n) and propose the up to k
tokens that followed it. Costs no model call, so a wrong draft only costs the verify rows.
Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier match of the longest suffix of
        tokens; [] when no suffix of length min_n..max_n occurred before."""
        if k <= 0:
            return []
        start = self.find_match(tokens)
        return [] if start is None else list(tokens[start : start + k])

    def find_match(self, tokens: Sequence[int]) -> int | None:
        """Where the continuation of the best match starts (an index into tokens), or None."""
        num = len(tokens)
        if num < self.min_n + 1:
            return None
        last = tokens[-1]
        # Every match ends with the last token: find its earlier occurrences once (one C-speed
        # pass), newest first; each must leave at least one token after it.
        ends = [i for i, t in enumerate(tokens[: num - 1]) if t == last]
        ends.reverse()
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = list(tokens[num - n :])
            for end in ends:
                if end >= n - 1 and list(tokens[end - n + 1 : end + 1]) == suffix:
                    return end + 1
        return None
