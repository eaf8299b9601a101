"""StepCostModel: what a decode step costs as a function of the tokens it computes.

seconds ~ a + c * verifies + b * num_tokens, fitted by exponentially decayed least squares over
recent all-decode steps (plain decodes and verifies, no prompt chunks: those are what the
policy's choice of k changes). b is the marginal price of one more draft token in the batch;
c is what a step pays once for verifying anything at all (its verifying sequences leave the
batched decode path: on CPU that jump is about as large as several tokens). c is fitted only
when verify steps of different sizes make it separable from b; otherwise c = 0 and b absorbs
it (a straight line through the sizes seen). Until the steps have varied enough in size to fit
b (speculation is what varies them), b is assumed to be half the average cost per token --
between a memory-bound step (b ~ 0) and a fully compute-bound one (b = seconds / tokens); a
fitted b is kept at or above 5% of that. Torch-free.
"""

from __future__ import annotations

MIN_FRACTION = 0.05  # b is at least this fraction of the mean cost per token


class StepCostModel:
    def __init__(self, decay: float = 0.995, prior_fraction: float = 0.5):
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.prior_fraction = prior_fraction
        # Decayed sums of 1, x (tokens), v (verifies), y (seconds) and their products.
        self._s = dict.fromkeys(("w", "x", "v", "y", "xx", "xv", "xy", "vy"), 0.0)

    def observe(self, num_tokens: int, seconds: float, verifies: bool = False) -> None:
        d, s = self.decay, self._s
        x, v, y = float(num_tokens), float(verifies), seconds
        for key, value in (("w", 1.0), ("x", x), ("v", v), ("y", y), ("xx", x * x), ("xv", x * v)):
            s[key] = s[key] * d + value
        s["xy"] = s["xy"] * d + x * y
        s["vy"] = s["vy"] * d + v * y

    @property
    def has_data(self) -> bool:
        return self._s["w"] > 0

    def fit(self) -> tuple[float, float, float]:
        """(a, b, c): fixed seconds, seconds per token, and seconds once per verifying step."""
        s = self._s
        w = s["w"]
        if not w:
            return 0.0, 0.0, 0.0
        mx, mv, my = s["x"] / w, s["v"] / w, s["y"] / w
        cxx = s["xx"] / w - mx * mx
        cvv = mv - mv * mv  # v is 0 or 1
        cxv = s["xv"] / w - mx * mv
        cxy = s["xy"] / w - mx * my
        cvy = s["vy"] / w - mv * my
        per_token = my / max(mx, 1.0)
        low, high = MIN_FRACTION * per_token, per_token
        b = c = None
        det = cxx * cvv - cxv * cxv
        # Separable only when verify steps came in several sizes (x varies beyond what v explains).
        if cvv > 1e-3 and cxx > 0.25 and det > 0.05 * cxx * cvv:
            b = (cxy * cvv - cvy * cxv) / det
            c = (cvy * cxx - cxy * cxv) / det
            if not (low <= b <= high and 0.0 <= c <= my):
                b = c = None  # implausible (noise): fall back to the straight line
        if b is None:
            c = 0.0
            if cxx < 0.25:  # sizes within about +-0.5 token of each other: b is not identifiable
                b = self.prior_fraction * per_token
            else:
                # Between a floor and fully compute-bound. The floor: a draft token is never
                # free, and noisy timings (a shared machine) must not fit b ~ 0, which would
                # make every draft look worth verifying whatever its acceptance.
                b = min(max(cxy / cxx, low), high)
        return max(my - b * mx - c * mv, 0.0), b, c

    def step_seconds(self, num_tokens: int, verifies: bool = False) -> float:
        a, b, c = self.fit()
        return a + b * num_tokens + (c if verifies else 0.0)
