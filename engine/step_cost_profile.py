"""StepCostProfile: what an engine's steps cost lately, for the router's choice between a
decode replica's local prefill and a remote one (cluster/routing/prefill_placement.py).

- prefill, two lines by the forward a step runs:
  - fresh: a step of one prompt's first chunk alone (no cached prefix, no other row) -- on CPU
    the scripted prefill (engine/model/prefill_graph.py), one TorchScript call;
  - mixed: any other prefilling step (a prompt's tail after a prefix hit, later chunks,
    prompts mixed with each other or with decode rows) -- the eager forward.
  The two differ by more than their forwards: a short tail's step is mostly fixed cost (the
  tiny test model: a 32-token tail 1.2 ms, a whole 256-token prompt 1.4 ms scripted, 1.75 eager),
  and an unwarmed scripted method's first calls are TorchScript's profiling runs (46 and 18 ms;
  scripted_decode.warm_prefill). One line over both priced one kind from the other's steps, and
  sent an idle decode replica's tail remote (issue 41).
  Each prices a step as step + per_token * tokens, from a least-squares line through its recent
  steps' (tokens, forward seconds), over EWMAs of their moments. A step's fixed cost (kernel
  launches, the layers' per-call overheads, sampling) is large against a short prompt's
  tokens: a plain seconds-per-token figure read off short prompts overprices a long one (a
  decode replica's own prefills are mostly short remainders) by several times.
  While a line's recent steps are all about one size, no line can be fitted: the fixed cost is
  then 0 and per_token the ratio of the mean seconds to the mean tokens.
- decode step seconds: an EWMA of the forward seconds of the steps that only decode.

Every figure is 0.0 until a step of its kind ran (a cold replica: the router falls back to its
threshold rule, or to the other prefill line). EWMAs, not running means, so the figures follow
the load and a replica's warm-up does not weigh forever. torch-free; a few multiplications a step.
"""

from __future__ import annotations

# Weight of the newest step: about the last eight steps of a kind carry the figures.
EWMA_WEIGHT = 0.25
# The recent prefill steps' token counts must spread by this coefficient of variation for a line.
MIN_TOKENS_SPREAD = 0.05


class PrefillLine:
    """One kind of prefilling step's cost: a least-squares line over EWMAs of the moments."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        # EWMAs over the steps of n (tokens), t (seconds), n*n and n*t; None while cold.
        self._moments: list[float] | None = None

    def add(self, seconds: float, num_tokens: int) -> None:
        sample = [float(num_tokens), seconds, float(num_tokens) ** 2, num_tokens * seconds]
        if self._moments is None:
            self._moments = sample
        else:
            self._moments = [m + self.weight * (s - m) for m, s in zip(self._moments, sample, strict=True)]

    def fit(self) -> tuple[float, float]:
        """(fixed seconds per step, seconds per token); (0.0, 0.0) while cold."""
        if self._moments is None:
            return 0.0, 0.0
        n, t, nn, nt = self._moments
        variance = nn - n * n
        if variance > (MIN_TOKENS_SPREAD * n) ** 2:
            per_token = (nt - n * t) / variance
            step = t - per_token * n
            if per_token > 0 and step >= 0:
                return step, per_token
        return 0.0, t / n  # one size lately, or a line through an odd sample: the ratio of means


class StepCostProfile:
    def __init__(self, weight: float = EWMA_WEIGHT) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"the EWMA weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.decode_step_seconds = 0.0
        self.mixed_prefill = PrefillLine(weight)
        self.fresh_prefill = PrefillLine(weight)

    def record(self, seconds: float, num_tokens: int, num_prefill_tokens: int, fresh_prompt: bool = False) -> None:
        """One step's forward seconds, the tokens it computed and how many of them were prompt
        tokens; fresh_prompt: the step was one prompt's first chunk alone. A step of unknown
        shape (num_tokens 0) teaches nothing."""
        if num_tokens <= 0 or seconds < 0:
            return
        if num_prefill_tokens > 0:
            (self.fresh_prefill if fresh_prompt else self.mixed_prefill).add(seconds, num_tokens)
        elif self.decode_step_seconds == 0.0:
            self.decode_step_seconds = seconds
        else:
            self.decode_step_seconds += self.weight * (seconds - self.decode_step_seconds)

    def stats(self) -> dict[str, float]:
        """EngineStats' step cost fields."""
        step, per_token = self.mixed_prefill.fit()
        fresh_step, fresh_per_token = self.fresh_prefill.fit()
        return {
            "prefill_step_seconds": step,
            "prefill_seconds_per_token": per_token,
            "fresh_prefill_step_seconds": fresh_step,
            "fresh_prefill_seconds_per_token": fresh_per_token,
            "decode_step_seconds": self.decode_step_seconds,
        }
