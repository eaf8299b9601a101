"""StepCostModel: what a decode step costs as a function of the tokens it computes.

seconds ~ a + b * num_tokens, fitted by exponentially decayed least squares over recent
all-decode steps (plain decodes and verifies, no prompt chunks: those are what the policy's
choice of k changes). b is the marginal price of one more draft token in the batch. Until the
steps have varied enough in size to fit b (speculation is what varies them), b is assumed to
be half the average cost per token -- between a memory-bound step (b ~ 0) and a fully
compute-bound one (b = seconds / tokens); a fitted b is kept at or above 5% of that. Torch-free.
"""

from __future__ import annotations

MIN_FRACTION = 0.05  # b is at least this fraction of the mean cost per token


class StepCostModel:
    def __init__(self, decay: float = 0.995, prior_fraction: float = 0.5):
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.prior_fraction = prior_fraction
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + num_tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + num_tokens * num_tokens
        self._xy = self._xy * d + num_tokens * seconds

    @property
    def has_data(self) -> bool:
        return self._w > 0

    def fit(self) -> tuple[float, float]:
        """(a, b): fixed and per-token seconds; b from the prior while the sizes barely varied."""
        if not self._w:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        per_token = mean_y / max(mean_x, 1.0)
        if var_x < 0.25:  # sizes within about +-0.5 token of each other: b is not identifiable
            b = self.prior_fraction * per_token
        else:
            b = (self._xy / self._w - mean_x * mean_y) / var_x
            # Between a floor and fully compute-bound. The floor: a draft token is never free,
            # and noisy timings (a shared machine) must not fit b ~ 0, which would make every
            # draft look worth verifying whatever its acceptance.
            b = min(max(b, MIN_FRACTION * per_token), per_token)
        return max(mean_y - b * mean_x, 0.0), b

    def step_seconds(self, num_tokens: int) -> float:
        a, b = self.fit()
        return a + b * num_tokens
