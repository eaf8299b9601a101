"""LoadForecast: the next interval's demand, from the ingresses' cumulative counters.

What is observed (summed over every ingress by the controller's MetricsAggregator):
prompt tokens received (counted at arrival), and the prompt and generated tokens of finished
requests (their histograms' sums and counts). From two windows of `window_s`:

  mean input  = finished requests' prompt tokens / finished requests    (last window)
  mean output = finished requests' generated tokens / finished requests
  rate        = prompt tokens received / mean input / window_s           (arrivals, not finishes)
  forecast    = rate + the slope between the two windows' midpoints x (horizon_s + window_s / 2),
                at least 0 (the rate is the window's mean: it stands at the window's midpoint)

A straight line through the last two windows: simple, and it measures well on ramps (the
forecast error is logged with every decision and checked in tests/cluster/scaling/test_sla_policy.py).
Until a request has finished in the window there are no lengths, and nothing is forecast.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class DemandTotals:
    """Cumulative counters at one moment (they only grow)."""

    prompt_tokens_received: float
    finished_requests: float
    finished_prompt_tokens: float
    finished_output_tokens: float


@dataclass(frozen=True)
class Forecast:
    rate: float  # req/s over the last window
    predicted_rate: float  # req/s at now + horizon
    mean_input_tokens: float
    mean_output_tokens: float

    def describe(self) -> str:
        return (
            f"{self.rate:.3g} req/s now, {self.predicted_rate:.3g} req/s forecast, "
            f"{self.mean_input_tokens:.0f} in / {self.mean_output_tokens:.0f} out tokens"
        )


class LoadForecast:
    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, DemandTotals]] = deque()

    def observe(self, now: float, totals: DemandTotals) -> None:
        self._samples.append((now, totals))
        while len(self._samples) > 2 and self._samples[1][0] <= now - 2 * self.window_s:
            self._samples.popleft()  # keep one sample at or before two windows back

    def _at(self, when: float) -> tuple[float, DemandTotals] | None:
        """The newest sample taken at or before `when`."""
        found = None
        for sample in self._samples:
            if sample[0] > when:
                break
            found = sample
        return found

    def estimate(self, now: float, horizon_s: float) -> Forecast | None:
        if not self._samples:
            return None
        newest_at, newest = self._samples[-1]
        start = self._at(now - self.window_s)
        if start is None:
            return None  # less than one window observed
        start_at, begin = start
        finished = newest.finished_requests - begin.finished_requests
        if finished <= 0 or newest_at <= start_at:
            return None
        mean_in = max((newest.finished_prompt_tokens - begin.finished_prompt_tokens) / finished, 1.0)
        mean_out = max((newest.finished_output_tokens - begin.finished_output_tokens) / finished, 1.0)
        rate = (newest.prompt_tokens_received - begin.prompt_tokens_received) / mean_in / (newest_at - start_at)
        earlier = self._at(start_at - self.window_s)
        slope = 0.0
        if earlier is not None and earlier[0] < start_at:
            before = (
                (begin.prompt_tokens_received - earlier[1].prompt_tokens_received) / mean_in / (start_at - earlier[0])
            )
            slope = (rate - before) / ((newest_at - earlier[0]) / 2)  # between the windows' midpoints
        # The rate is the window's mean, i.e. at its midpoint: the forecast reaches from there.
        ahead = horizon_s + (newest_at - start_at) / 2
        return Forecast(rate, max(rate + slope * ahead, 0.0), mean_in, mean_out)
