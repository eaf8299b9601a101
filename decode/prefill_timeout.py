"""PrefillTimeout: how long decode waits for a remote prefill before it gives up on the prefill
replica (a hung one must not hold decode's reserved blocks until the request's deadline).

The limit follows the prefill pool's measured speed: seconds per prompt token of recent
remote prefills (an exponential moving average, queueing included, as the request sees it),
times `slack` for load swings, plus `floor_s` for the fixed costs (the Ray call, opening a
pair, the transfer) and a loaded machine; never above `ceiling_s` (the transfer timeout).
A false timeout costs a retry and the pair, so the limit errs long. Until a prefill has been measured, the ceiling
applies.
"""

from __future__ import annotations


class PrefillTimeout:
    def __init__(self, floor_s: float = 5.0, ceiling_s: float = 20.0, slack: float = 10.0, weight: float = 0.2):
        if not 0 < floor_s:
            raise ValueError(f"want 0 < floor_s, got {floor_s=}")
        if slack < 1 or not 0 < weight <= 1:
            raise ValueError(f"want slack >= 1 and 0 < weight <= 1, got {slack=}, {weight=}")
        self.floor_s, self.ceiling_s, self.slack, self.weight = floor_s, ceiling_s, slack, weight
        self.seconds_per_token: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A remote prefill of num_tokens prompt tokens answered after seconds."""
        if num_tokens <= 0 or seconds < 0:
            return
        rate = seconds / num_tokens
        prev = self.seconds_per_token
        self.seconds_per_token = rate if prev is None else prev + self.weight * (rate - prev)

    def limit_s(self, num_tokens: int) -> float:
        if self.seconds_per_token is None:
            return self.ceiling_s
        return min(self.ceiling_s, self.floor_s + self.slack * self.seconds_per_token * num_tokens)
