"""SpeculationPolicy: how many draft tokens each decoding sequence verifies this step.

The adaptive policy prices a draft token. With B sequences decoding and a step costing T
seconds, the batch emits B / T tokens per second; one more draft token makes the step b
seconds longer (StepCostModel), which costs price = b * B / T tokens of everyone's output.
The j-th draft token of a sequence is emitted with probability alpha^j (alpha: its measured
per-token acceptance), so it pays iff alpha^j > price, and the sequence gets the largest k
(up to num_speculative_tokens) for which that holds, with a 10% margin (MARGIN). A step that
verifies anything also pays a fixed cost c (StepCostModel): unless the chosen drafts' expected
extra tokens, less their price, cover c * B / T, nobody speculates that step. Large batches
make price large, poor drafts make alpha small: either turns speculation off, per sequence,
with no threshold to tune.

alpha per request is its own accepted / tried draft tokens, shrunk towards the pool's rate
(PRIOR_WEIGHT pseudo-tries), so a new request starts from what the pool has seen.

Measuring needs speculating, so while price <= 1/2 the policy probes where it declined:
- every request tries k = 1 at its first step, and again after price / PROBE_BUDGET of its
  steps without a try (each try costs at most price tokens: about 1% of its output);
- at the first step and then once every PROBE_INTERVAL steps, one declined request (the one
  that tried least recently) gets the full num_speculative_tokens: that measures deep acceptance, and the larger step
  is what lets the cost model fit b at all. Its expected cost is below k * b / (64 * T) of
  the throughput: about 1% at batch 1, less at larger batches (T grows, one probe a step).
The fixed policy always asks for num_speculative_tokens. Torch-free.
"""

from __future__ import annotations

import math

from splitserve.engine.speculative.speculative_config import SpeculativeConfig
from splitserve.engine.speculative.step_cost_model import StepCostModel

PRIOR_WEIGHT = 4.0  # pseudo-tries of the pool's rate in a request's acceptance estimate
INITIAL_POOL_ACCEPTANCE = 0.5  # the pool's prior ...
POOL_PRIOR_WEIGHT = 2.0  # ... worth this many tries, so a few early rejections do not zero it
POOL_DECAY = 0.995  # per recorded draft: the pool's rate follows the last few hundred drafts
PROBE_INTERVAL = 64  # steps between deep probes (pool-wide)
PROBE_MAX_PRICE = 0.5
PROBE_BUDGET = 0.01  # a declined request re-tries k = 1 after price / PROBE_BUDGET steps: ~1% of its tokens
# A draft token must be expected to pay this much more than it costs: the cost and acceptance
# estimates are noisy, and near break-even speculation gains nothing worth the risk.
MARGIN = 1.1


class _RequestAcceptance:
    __slots__ = ("num_tried", "num_accepted", "last_try_step")

    def __init__(self):
        self.num_tried = 0
        self.num_accepted = 0
        self.last_try_step: int | None = None  # None: never tried (it probes at its first step)


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.max_k = config.num_speculative_tokens
        self.adaptive = config.policy == "adaptive"
        self.cost = StepCostModel()
        self._requests: dict[str, _RequestAcceptance] = {}
        self._pool_tried = 0.0
        self._pool_accepted = 0.0
        self._num_steps = 0
        self._last_deep_probe = -PROBE_INTERVAL  # the first step probes: cost and acceptance from the start

    # ---- decisions -----------------------------------------------------------------------
    def choose(self, request_ids: list[str]) -> dict[str, int]:
        """k for each of the decoding requests (all of the batch's decoding sequences)."""
        if not self.adaptive:
            return dict.fromkeys(request_ids, self.max_k)
        self._num_steps += 1
        price = self.price(len(request_ids))
        chosen = {rid: self._k_for(rid, price) for rid in request_ids}
        if any(chosen.values()) and self._net_gain(chosen, price) <= MARGIN * self.verify_price(len(request_ids)):
            chosen = dict.fromkeys(chosen, 0)  # the drafts would not cover a verify step's own cost
        if price <= PROBE_MAX_PRICE:
            self._probe(chosen, price)
        for rid, k in chosen.items():
            if k:
                self._requests[rid].last_try_step = self._num_steps
        return chosen

    def price(self, batch_size: int) -> float:
        """Tokens of output lost per draft token added to a step of batch_size decodes."""
        if batch_size <= 0:
            return math.inf
        if not self.cost.has_data:
            return self.cost.prior_fraction  # the cost model's own prior, before any step
        _, b, _ = self.cost.fit()
        seconds = self.cost.step_seconds(batch_size)
        return b * batch_size / seconds if seconds > 0 else math.inf

    def verify_price(self, batch_size: int) -> float:
        """Tokens of output lost by a step of batch_size decodes verifying anything at all."""
        if not self.cost.has_data or batch_size <= 0:
            return 0.0
        _, _, c = self.cost.fit()
        seconds = self.cost.step_seconds(batch_size)
        return c * batch_size / seconds if seconds > 0 else math.inf

    def _net_gain(self, chosen: dict[str, int], price: float) -> float:
        """Expected extra tokens of the chosen drafts, less what their tokens cost."""
        gain = 0.0
        for rid, k in chosen.items():
            alpha = self.acceptance(rid)
            gain += sum(alpha**j for j in range(1, k + 1)) - MARGIN * price * k
        return gain

    def _k_for(self, request_id: str, price: float) -> int:
        self._requests.setdefault(request_id, _RequestAcceptance())
        alpha = self.acceptance(request_id)
        bar = price * MARGIN  # what a draft token's acceptance must beat
        if bar <= 0:
            return self.max_k if alpha > 0 else 0
        if bar >= 1 or alpha <= bar:
            return 0
        if alpha >= 1:
            return self.max_k
        # alpha^j > bar  <=>  j < log(bar) / log(alpha)
        return max(0, min(math.ceil(math.log(bar) / math.log(alpha)) - 1, self.max_k))

    def _probe(self, chosen: dict[str, int], price: float) -> None:
        declined = [rid for rid, k in chosen.items() if k == 0]
        if not declined:
            return
        retry_after = price / PROBE_BUDGET
        for rid in declined:
            last = self._requests[rid].last_try_step
            if last is None or self._num_steps - last >= retry_after:
                chosen[rid] = 1  # a new request's first step, or a declined one's re-try
        if self._num_steps - self._last_deep_probe >= PROBE_INTERVAL:
            stalest = min(declined, key=lambda rid: self._requests[rid].last_try_step or 0)
            chosen[stalest] = self.max_k
            self._last_deep_probe = self._num_steps

    def acceptance(self, request_id: str) -> float:
        """Estimated probability that a draft token of request_id is accepted."""
        state = self._requests.get(request_id)
        pool = self.pool_acceptance
        if state is None:
            return pool
        return (state.num_accepted + PRIOR_WEIGHT * pool) / (state.num_tried + PRIOR_WEIGHT)

    @property
    def pool_acceptance(self) -> float:
        prior = POOL_PRIOR_WEIGHT
        return (self._pool_accepted + prior * INITIAL_POOL_ACCEPTANCE) / (self._pool_tried + prior)

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

    def record_step(self, num_tokens: int, seconds: float, verifies: bool = False) -> None:
        """An all-decode step's size (tokens computed, drafts included), wall time, and whether
        it verified any draft."""
        self.cost.observe(num_tokens, seconds, verifies)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
