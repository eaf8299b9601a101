"""StepCostProfile: what an engine's steps cost lately, for the router's choice between a
decode replica's local prefill and a remote one (cluster/routing/prefill_placement.py).

- prefill seconds per token: an EWMA, over the steps that prefill anything (prompt chunks,
  alone or mixed with decode rows), of the step's forward seconds per token it computed;
- decode step seconds: an EWMA of the forward seconds of the steps that only decode.

Both are 0.0 until a step of that kind ran (a cold replica: the router falls back to its
threshold rule). An EWMA, not a running mean, so the figures follow the load and a replica's
warm-up does not weigh forever. torch-free; two multiplications a step.
"""

from __future__ import annotations

# Weight of the newest step: about the last eight steps of a kind carry the figure.
EWMA_WEIGHT = 0.25


class StepCostProfile:
    def __init__(self, weight: float = EWMA_WEIGHT) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"the EWMA weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.prefill_seconds_per_token = 0.0
        self.decode_step_seconds = 0.0

    def record(self, seconds: float, num_tokens: int, num_prefill_tokens: int) -> None:
        """One step's forward seconds, the tokens it computed and how many of them were prompt
        tokens. A step of unknown shape (num_tokens 0) teaches nothing."""
        if num_tokens <= 0 or seconds < 0:
            return
        if num_prefill_tokens > 0:
            self.prefill_seconds_per_token = self._mix(self.prefill_seconds_per_token, seconds / num_tokens)
        else:
            self.decode_step_seconds = self._mix(self.decode_step_seconds, seconds)

    def _mix(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.weight * (new - old)

    def stats(self) -> dict[str, float]:
        """EngineStats' step cost fields."""
        return {
            "prefill_seconds_per_token": self.prefill_seconds_per_token,
            "decode_step_seconds": self.decode_step_seconds,
        }
