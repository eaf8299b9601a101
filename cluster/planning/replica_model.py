"""ReplicaModel: one engine replica as the planner sees it -- the real scheduler's batching,
step by step, with the step time the profile gives each batch.

Each step is composed as `engine/core/scheduler.py` composes it: the running sequences first
(one token per decoding sequence, then the next chunk of a prompt already started), then the
waiting ones in arrival order, while the token budget (max_num_batched_tokens) and
max_num_seqs allow; a prompt longer than the budget left is chunked. The step takes
`profile.step_s(new tokens, context tokens)`. What is left out: KV-block exhaustion and
preemption (the cache is assumed to hold max_num_seqs sequences), async scheduling's overlap
(the simulated engine's step is the profile's wait either way) and prefix-cache hits.

Decoding sequences are kept as aggregates, so a step costs O(1) however large the batch: the
sum of their computed tokens, and a heap of the step index at which each one ends. A request's
inter-token gaps are the durations of the steps it decoded in; `slow_steps` counts the steps
longer than the ITL target so far, so a request's gaps over the target are the difference of
two counter readings (`PlannedOutcome.slow_gaps`).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from splitserve.engine.simulated.step_time_profile import StepTimeProfile


@dataclass
class PlannedOutcome:
    """What the model predicts for one request."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    first_token_s: float = float("inf")
    finish_s: float = float("inf")
    gaps: int = 0  # inter-token gaps (decode steps taken part in)
    slow_gaps: int = 0  # of them, longer than the ITL target
    # while it runs on a replica: prompt tokens computed; its slow-step and step readings at admission
    computed: int = 0
    slow_at_admit: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(order=True)
class _Decoding:
    last_step: int  # the index of the step that samples its last token
    first_step: int = field(compare=False)
    computed_at_first: int = field(compare=False)  # computed tokens before its first decode step
    outcome: PlannedOutcome = field(compare=False)


class ReplicaModel:
    """prefill_only: a disaggregated prefill replica (a request leaves once its first token is
    sampled); otherwise a replica that decodes (a decode replica, or colocated: it also prefills)."""

    def __init__(
        self,
        profile: StepTimeProfile,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        itl_target_s: float,
        prefill_only: bool = False,
    ):
        self.profile = profile
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.itl_target_s = itl_target_s
        self.prefill_only = prefill_only
        self.waiting: deque[PlannedOutcome] = deque()  # prompts to compute
        self.joining: list[PlannedOutcome] = []  # prefilled elsewhere: they join the batch next step
        self.prefilling: list[PlannedOutcome] = []  # admitted prompts not yet computed in full
        self.decoding: list[_Decoding] = []  # heap by last_step
        self.decoding_computed = 0  # the decoding sequences' computed tokens, all together
        self.steps = 0
        self.slow_steps = 0
        self.busy_until: float | None = None  # the end of the step in flight; None: idle
        self._step: tuple[list[tuple[PlannedOutcome, int]], list[PlannedOutcome], float] | None = None
        self.step_log: list[tuple[float, int]] = []  # (duration, decoding sequences) per step
        self.queued_prompt_tokens = 0  # prompt tokens not yet computed, waiting or started
        self.assigned = 0  # requests routed here and not finished (a router's load signal)

    def add(self, outcome: PlannedOutcome) -> None:
        """A new prompt (to prefill), or a request prefilled elsewhere, which joins the running
        batch at once (`Scheduler.add_prefilled`: max_num_seqs does not hold it back)."""
        if outcome.computed >= outcome.input_tokens:
            self.joining.append(outcome)
            return
        self.waiting.append(outcome)
        self.queued_prompt_tokens += outcome.input_tokens - outcome.computed

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.joining or self.prefilling or self.decoding)

    def start_step(self, now: float) -> float:
        """Compose the next batch at now; returns when the step ends."""
        admitted, self.joining = self.joining, []
        num_decoding = len(self.decoding)
        budget = self.budget - num_decoding - len(admitted)
        context = self.decoding_computed + num_decoding
        if admitted:
            context += sum(o.computed + 1 for o in admitted)
        chunks: list[tuple[PlannedOutcome, int]] = []
        for outcome in self.prefilling:
            if budget <= 0:
                break
            chunk = min(outcome.input_tokens - outcome.computed, budget)
            chunks.append((outcome, chunk))
            budget -= chunk
            context += outcome.computed + chunk
        running = num_decoding + len(admitted) + len(self.prefilling)
        while self.waiting and budget > 0 and running < self.max_num_seqs:
            outcome = self.waiting.popleft()
            running += 1
            self.prefilling.append(outcome)
            chunk = min(outcome.input_tokens - outcome.computed, budget)
            chunks.append((outcome, chunk))
            budget -= chunk
            context += outcome.computed + chunk
        new_tokens = self.budget - budget
        duration = self.profile.step_s(new_tokens, context)
        for outcome in admitted:
            self._start_decoding(outcome, outcome.input_tokens, self.steps)
        self._step = (chunks, admitted, duration)
        self.busy_until = now + duration
        return self.busy_until

    def _start_decoding(self, outcome: PlannedOutcome, computed: int, first_step: int) -> None:
        """outcome decodes from step first_step on; it has output_tokens - 1 tokens still to sample."""
        remaining = outcome.output_tokens - 1
        outcome.slow_at_admit = self.slow_steps
        heapq.heappush(self.decoding, _Decoding(first_step + remaining - 1, first_step, computed, outcome))
        self.decoding_computed += computed

    def finish_step(self) -> tuple[list[PlannedOutcome], list[PlannedOutcome]]:
        """Apply the step in flight at its end: returns (prefilled here, finished here). A prefill
        replica's prefilled requests leave it; a decoding replica keeps them (they decode)."""
        assert self._step is not None and self.busy_until is not None
        chunks, _, duration = self._step
        now, step = self.busy_until, self.steps
        num_decoding = len(self.decoding)  # those admitted this step included; prompts finishing now join after
        self.step_log.append((duration, num_decoding))
        self.slow_steps += duration > self.itl_target_s
        self.decoding_computed += num_decoding
        prefilled: list[PlannedOutcome] = []
        if chunks:  # a decode-only step (most of them) changes no prompt
            for outcome, chunk in chunks:
                outcome.computed += chunk
                self.queued_prompt_tokens -= chunk
                if outcome.computed == outcome.input_tokens:
                    prefilled.append(outcome)
            self.prefilling = [o for o in self.prefilling if o.computed < o.input_tokens]
        finished: list[PlannedOutcome] = []
        while self.decoding and self.decoding[0].last_step <= step:
            done = heapq.heappop(self.decoding)
            self.decoding_computed -= done.computed_at_first + (step - done.first_step + 1)
            finished.append(self._finish(done.outcome, now, step - done.first_step + 1))
        for outcome in prefilled:
            if outcome.first_token_s == float("inf"):
                outcome.first_token_s = now  # the prefill's last chunk samples the first token
            if self.prefill_only:
                continue
            if outcome.output_tokens == 1:
                finished.append(self._finish(outcome, now, 0))
            else:
                self._start_decoding(outcome, outcome.input_tokens, step + 1)
        self.steps += 1
        self._step, self.busy_until = None, None
        return prefilled, finished

    def _finish(self, outcome: PlannedOutcome, now: float, gaps: int) -> PlannedOutcome:
        outcome.finish_s, outcome.gaps = now, gaps
        outcome.slow_gaps = self.slow_steps - outcome.slow_at_admit if gaps else 0
        self.assigned -= 1
        return outcome
