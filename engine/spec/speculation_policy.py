"""SpeculationPolicy: how many draft tokens each decoding sequence verifies this step.

The adaptive policy prices a draft token. With B sequences decoding and a step costing T
seconds, the batch emits B / T tokens per second; one more draft token makes the step b
seconds longer (StepCostModel), which costs price = b * B / T tokens of everyone's output.
The j-th draft token of a sequence is emitted with probability alpha^j (alpha: its measured
per-token acceptance), so it pays iff alpha^j > price, and the sequence gets the largest k
(up to num_speculative_tokens) for which that holds (with a 10% margin, MARGIN). Large batches make price large, poor
drafts make alpha small: either turns speculation off, per sequence, with no threshold to tune.

alpha per request is its own accepted / tried draft tokens, shrunk towards the pool's rate
(PRIOR_WEIGHT pseudo-tries), so a new request starts from what the pool has seen. A request
whose alpha says no tries k = 1 at its first step and every PROBE_INTERVAL of its steps while
price <= 1/2 (an expected cost below 1% of its tokens), so a request that starts repeating
itself is found.
The fixed policy always asks for num_speculative_tokens. Torch-free.
"""

from __future__ import annotations

import math

from splitserve.engine.spec.speculative_config import SpeculativeConfig
from splitserve.engine.spec.step_cost_model import StepCostModel

PRIOR_WEIGHT = 4.0  # pseudo-tries of the pool's rate in a request's acceptance estimate
INITIAL_POOL_ACCEPTANCE = 0.5  # before anything was measured
POOL_DECAY = 0.995  # per recorded draft: the pool's rate follows the last few hundred drafts
PROBE_INTERVAL = 64
PROBE_MAX_PRICE = 0.5
# A draft token must be expected to pay this much more than it costs: the cost and acceptance
# estimates are noisy, and near break-even speculation gains nothing worth the risk.
MARGIN = 1.1


class _RequestAcceptance:
    __slots__ = ("num_tried", "num_accepted", "steps_since_try")

    def __init__(self):
        self.num_tried = 0
        self.num_accepted = 0
        self.steps_since_try = PROBE_INTERVAL  # a new request tries once at its first step


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.max_k = config.num_speculative_tokens
        self.adaptive = config.policy == "adaptive"
        self.cost = StepCostModel()
        self._requests: dict[str, _RequestAcceptance] = {}
        self._pool_tried = 0.0
        self._pool_accepted = 0.0

    # ---- decisions -----------------------------------------------------------------------
    def choose(self, request_ids: list[str]) -> dict[str, int]:
        """k for each of the decoding requests (all of the batch's decoding sequences)."""
        if not self.adaptive:
            return dict.fromkeys(request_ids, self.max_k)
        price = self.price(len(request_ids))
        return {rid: self._k_for(rid, price) for rid in request_ids}

    def price(self, batch_size: int) -> float:
        """Tokens of output lost per draft token added to a step of batch_size decodes."""
        if batch_size <= 0:
            return math.inf
        if not self.cost.has_data:
            return self.cost.prior_fraction  # the cost model's own prior, before any step
        _, b = self.cost.fit()
        seconds = self.cost.step_seconds(batch_size)
        return b * batch_size / seconds if seconds > 0 else math.inf

    def _k_for(self, request_id: str, price: float) -> int:
        state = self._requests.setdefault(request_id, _RequestAcceptance())
        alpha = self.acceptance(request_id)
        bar = price * MARGIN  # what a draft token's acceptance must beat
        k = 0
        if 0 < bar < 1 and alpha > bar:
            # alpha^j > bar  <=>  j < log(bar) / log(alpha)
            k = self.max_k if alpha >= 1 else math.ceil(math.log(bar) / math.log(alpha)) - 1
            k = max(0, min(k, self.max_k))
        elif bar <= 0:
            k = self.max_k if alpha > 0 else 0
        if k == 0 and price <= PROBE_MAX_PRICE and state.steps_since_try >= PROBE_INTERVAL:
            k = 1
        state.steps_since_try = 0 if k else state.steps_since_try + 1
        return k

    def acceptance(self, request_id: str) -> float:
        """Estimated probability that a draft token of request_id is accepted."""
        state = self._requests.get(request_id)
        pool = self.pool_acceptance
        if state is None:
            return pool
        return (state.num_accepted + PRIOR_WEIGHT * pool) / (state.num_tried + PRIOR_WEIGHT)

    @property
    def pool_acceptance(self) -> float:
        if self._pool_tried < 1:
            return INITIAL_POOL_ACCEPTANCE
        return self._pool_accepted / self._pool_tried

    # ---- measurements --------------------------------------------------------------------
    def record_draft(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verified draft. Tried tokens: the accepted ones and the first rejected one
        (the tokens after a rejection say nothing about acceptance)."""
        if num_proposed <= 0:
            return
        num_tried = num_accepted + (num_accepted < num_proposed)
        state = self._requests.setdefault(request_id, _RequestAcceptance())
        state.num_tried += num_tried
        state.num_accepted += num_accepted
        self._pool_tried = self._pool_tried * POOL_DECAY + num_tried
        self._pool_accepted = self._pool_accepted * POOL_DECAY + num_accepted

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """An all-decode step's size (tokens computed, drafts included) and wall time."""
        self.cost.observe(num_tokens, seconds)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
