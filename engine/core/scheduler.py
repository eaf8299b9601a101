"""Continuous-batching scheduler with chunked prefill, priorities and preemption by recompute.

It sees sequences and block counts only, never tensors. Every request has a priority
(`SamplingParams.priority`, vLLM's: lower runs first). Every step: running sequences first
(decodes and unfinished prefill chunks; higher priority first, then oldest), then waiting
ones, ordered by (priority, arrival), while the token budget, max_num_seqs and free blocks
allow. When a running sequence cannot grow, the lowest-priority running sequence (the newest
among equals) is preempted; when a waiting sequence cannot be admitted, running sequences of a
strictly lower priority are preempted for it. A preempted sequence's blocks are freed (they
keep their hashes, so the recompute usually hits the prefix cache) and it goes back to the
head of its priority's place in the waiting queue. With every priority equal this is plain FCFS.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from splitserve.engine.core.draft_lookahead import reserve_lookahead
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.lora_admission import AdapterLimit
from splitserve.engine.core.sampled_tokens import apply_sampled
from splitserve.engine.core.scheduled_batch import ScheduledBatch
from splitserve.engine.core.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        max_loras: int | None = None,
        mixed_step_prefill_tokens: int = 0,
    ):
        """max_loras: the LoRA adapters a step may use (engine/core/lora_admission.py); None
        where the engine serves none. mixed_step_prefill_tokens: the prompt tokens (chunks of
        running prefills and new admissions together) a step that carries decode rows may
        compute; a step with no decode row takes the whole max_num_batched_tokens for them, so
        a prompt alone still prefills in one step. Every running sequence waits for its step's
        prompt chunks: the cap bounds how much they stretch its inter-token latency. 0: no cap."""
        self.kv = kv
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mixed_step_prefill_tokens = mixed_step_prefill_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.preemptions_by_priority: dict[int, int] = {}  # the preempted requests' priorities
        self.num_computed_prompt_tokens = 0

    # ---- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.requests[seq.request_id] = seq
        self._enqueue(seq, ahead_of_equals=False)

    def _enqueue(self, seq: Sequence, ahead_of_equals: bool) -> None:
        """Into the waiting queue behind every sequence of a higher priority (lower value); a new
        arrival also behind its equals, a preempted one ahead of them (it arrived earlier)."""
        priority = seq.params.priority
        index = len(self.waiting)
        while index > 0:
            other = self.waiting[index - 1].params.priority
            if other < priority or (other == priority and not ahead_of_equals):
                break
            index -= 1
        self.waiting.insert(index, seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV is already in its blocks (disaggregated decode)."""
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.requests[seq.request_id] = seq
        seq.status = SequenceStatus.RUNNING
        self.kv.cache_computed_blocks(seq)
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_output_placeholders = 0
        self.kv.free(seq)
        self.requests.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self.finish(seq, "abort")
        return seq

    def release_prefilled(self, seq: Sequence) -> None:
        """Drop a prefill-only sequence's hold on its blocks (they stay cached, evictable)."""
        if seq.status is SequenceStatus.PREFILLED:
            seq.status = SequenceStatus.FINISHED
            self.kv.free(seq)
            self.requests.pop(seq.request_id, None)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self, lookahead: dict[str, int] | None = None, ahead: bool = False) -> ScheduledBatch:
        """The next step's batch. lookahead: request id -> draft tokens to reserve slots for
        (speculative decoding; decoding sequences only). Lookahead comes last: it takes only
        the token budget and free blocks left once running and newly admitted sequences have
        theirs, so speculation never preempts a sequence or delays an admission.

        ahead: async scheduling's step scheduled while another one runs. A running request
        that cannot grow preempts nobody (a preempted request loses the step in flight, and
        among equals would again the next time): it and those after it wait for a step
        scheduled once the tokens are in. A waiting request still preempts lower priorities.
        A waiting request whose next uncached block a step in flight is writing is admitted one
        step later, from the prefix cache, instead of computing that block again."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # Higher priority first, admission order among equals (a stable sort): the budget goes
        # to them first, and pop() below preempts the lowest priority, newest first.
        self.running.sort(key=lambda s: s.params.priority)
        adapters = AdapterLimit(self.max_loras, self.running)
        prompt_budget = self._prompt_budget()
        idx = 0
        blocked = False
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            remaining = seq.num_tokens_with_placeholders - seq.num_computed_tokens
            num_new = min(remaining, budget, prompt_budget if remaining > 1 else budget)
            # Async scheduling only: nothing to run. Or the step has max_loras adapters already.
            if num_new <= 0 or self._ends_in_flight(seq) or not adapters.takes_running(seq):
                idx += 1
                continue
            stop = False
            while not self.kv.allocate_slots(seq, num_new):
                if ahead:
                    stop = blocked = True
                    break
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    stop = True
                    break
            if stop:
                break
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.num_draft_tokens.append(0)
            budget -= num_new
            if remaining > 1:
                prompt_budget -= num_new
            idx += 1
        if not batch.preempted and not blocked:
            in_flight = self._in_flight_block_hashes() if ahead else None
            budget = self._admit_waiting(batch, budget, prompt_budget, adapters, in_flight)
        if self.max_loras is not None:
            batch.running_adapters = {seq.params.lora_adapter for seq in self.running if seq.params.lora_adapter}
        if lookahead:
            reserve_lookahead(self, batch, lookahead, budget)
        return batch

    def _prompt_budget(self) -> int:
        """The step's budget for prompt chunks (rows of more than one token): the cap while a
        running sequence decodes this step (one token to compute), else the whole budget."""
        cap = self.mixed_step_prefill_tokens
        if cap and any(
            s.num_tokens_with_placeholders - s.num_computed_tokens == 1 and not self._ends_in_flight(s)
            for s in self.running
        ):
            return min(cap, self.max_num_batched_tokens)
        return self.max_num_batched_tokens

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """The step in flight samples seq's last token (max_tokens or the context length):
        nothing of it is scheduled ahead (vLLM's AsyncScheduler skips these too)."""
        placeholders = seq.num_output_placeholders
        return placeholders > 0 and (
            seq.num_output_tokens + placeholders >= seq.params.max_tokens
            or seq.num_tokens_with_placeholders >= self.max_model_len
        )

    def commit(self, batch: ScheduledBatch) -> None:
        """Async scheduling (engine/step_pipeline.py): the batch is submitted, its positions
        count as computed now (so the next step is scheduled past them), and each sequence it
        samples for holds a placeholder for that token until update() appends it."""
        assert not batch.draft_token_ids, "speculative decoding steps synchronously"
        batch.starts = [seq.num_computed_tokens for seq in batch.seqs]
        batch.preemptions = [seq.num_preemptions for seq in batch.seqs]
        batch.placeholders = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            samples = seq.num_computed_tokens + num_new == seq.num_tokens_with_placeholders
            seq.num_computed_tokens += num_new
            placeholder = samples and not seq.prefill_only  # a prefill-only one stops there
            seq.num_output_placeholders += placeholder
            batch.placeholders.append(placeholder)

    def _in_flight_block_hashes(self) -> set[int]:
        """Async scheduling: the full blocks steps in flight are writing (counted computed by
        commit, entered into the prefix cache only once written), by hash."""
        hashes: set[int] = set()
        if not self.waiting or not self.kv.pool.enable_caching:
            return hashes
        for seq in self.running:
            num_full = seq.num_computed_tokens // self.kv.block_size
            if num_full > seq.num_registered_blocks:
                seq.update_block_hashes()
                hashes.update(seq.block_hashes[seq.num_registered_blocks : num_full])
        return hashes

    def _admit_waiting(
        self,
        batch: ScheduledBatch,
        budget: int,
        prompt_budget: int,
        adapters: AdapterLimit,
        in_flight: set[int] | None = None,
    ) -> int:
        """Admits waiting sequences in order while the step's budgets allow; prompt_budget: what
        of the step's budget prompt chunks may still take (_prompt_budget). The budget left."""
        while self.waiting and budget > 0 and prompt_budget > 0:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs and not self._preempt_for(seq, batch):
                break
            if not adapters.takes_waiting(seq):
                break  # it and those behind it wait for an adapter slot, in order
            # Prompt log-probabilities need every prompt position's logits: such a request reads
            # no cached blocks until they are all computed (it recomputes a cached prefix; its
            # own blocks still enter the cache, where another copy is not there already).
            cached = [] if seq.needs_prompt_logprobs else self.kv.find_cached_blocks(seq)
            if in_flight and not seq.needs_prompt_logprobs and self._next_block_in_flight(seq, cached, in_flight):
                break  # it and those behind it wait a step, in order
            num_new = min(seq.num_tokens - len(cached) * self.kv.block_size, budget, prompt_budget)
            if not self.kv.allocate_prompt(seq, cached, num_new):
                if self._preempt_for(seq, batch):
                    budget = self.max_num_batched_tokens - batch.num_tokens
                    continue
                break
            self.waiting.popleft()
            if seq.queue_seconds is None:
                seq.queue_seconds = time.monotonic() - seq.arrival_time
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.num_draft_tokens.append(0)
            budget -= num_new
            prompt_budget -= num_new
        return budget

    def _next_block_in_flight(self, seq: Sequence, cached: list[int], in_flight: set[int]) -> bool:
        hashes = seq.block_hashes  # find_cached_blocks brought them up to date
        return len(cached) < min(len(hashes), (seq.num_tokens - 1) // self.kv.block_size) and (
            hashes[len(cached)] in in_flight
        )

    def _preempt_for(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Preempts the lowest-priority running sequence (newest among equals) if its priority
        is strictly lower than seq's, taking it out of this step's batch if it was in it.
        False when no running sequence ranks below seq."""
        if not self.running:
            return False
        # Sequences admitted this step sit at the end, whatever their priority: search.
        index = max(range(len(self.running)), key=lambda i: (self.running[i].params.priority, i))
        if self.running[index].params.priority <= seq.params.priority:
            return False
        victim = self.running.pop(index)
        if victim in batch.seqs:
            index = batch.seqs.index(victim)
            for column in (batch.seqs, batch.num_new_tokens, batch.num_draft_tokens):
                del column[index]
        self._preempt(victim)
        batch.preempted.append(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_output_placeholders = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        priority = seq.params.priority
        self.preemptions_by_priority[priority] = self.preemptions_by_priority.get(priority, 0) + 1
        self._enqueue(seq, ahead_of_equals=True)

    def update(
        self, batch: ScheduledBatch, sampled: dict[str, tuple[Any, ...] | list[tuple[Any, ...]]]
    ) -> list[Sequence]:
        """A finished step's sampled tokens applied (engine/core/sampled_tokens.py): the
        sequences that received a token this step."""
        return apply_sampled(self, batch, sampled)
