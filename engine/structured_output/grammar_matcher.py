"""One constrained request's grammar state: which tokens may come next, advanced by every
token the request accepts. It lives on the Sequence (seq.grammar), so preemption by
recompute keeps it (the recompute re-reads tokens the matcher already accepted).

Speculative decoding hook: rollback(n) undoes the last n accepted tokens (llguidance keeps
the history), so a verifier can accept a draft's tokens one by one to build its masks and
roll back the rejected suffix. accept_tokens() advances by a whole draft at once and
num_valid_tokens() says how much of one the grammar allows without consuming it.
"""

from __future__ import annotations


class GrammarMatcher:
    __slots__ = ("_matcher", "vocab_size", "num_accepted")

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher  # llguidance.LLMatcher, never advanced before
        self.vocab_size = vocab_size
        self.num_accepted = 0

    @property
    def ll_matcher(self):
        """The llguidance matcher, for batched mask computation (GrammarMask)."""
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher is then in an error state)
        when the grammar does not allow it."""
        ok = self._matcher.consume_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Advance by as many of token_ids as the grammar allows; returns how many."""
        num = self._matcher.try_consume_tokens(list(token_ids))
        self.num_accepted += num
        return num

    def num_valid_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of token_ids the grammar allows from here (nothing is consumed):
        a speculative draft is cut to that prefix before it is verified."""
        return self._matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding's rejected drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self._matcher.get_error()}")
        self.num_accepted -= num_tokens

    def allowed_token_ids(self) -> list[int]:
        """The ids allowed next (tests and debugging; the engine fills bitmasks instead)."""
        mask = self._matcher.compute_bitmask()
        return [i for i in range(min(self.vocab_size, 8 * len(mask))) if mask[i >> 3] >> (i & 7) & 1]

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (only EOS could follow) or the matcher failed."""
        return self._matcher.is_stopped()

    @property
    def finish_reason(self) -> str:
        """How a terminated request finishes: "stop" when the output matched, "abort" when
        the matcher failed (a token it rejected: never expected, the mask forbids those)."""
        return "abort" if self._matcher.is_error() else "stop"

    @property
    def error(self) -> str:
        return self._matcher.get_error()
