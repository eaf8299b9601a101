"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

It sees sequences and block counts only, never tensors. Every step: running sequences first
(decodes and unfinished prefill chunks, oldest first), then waiting ones while the token budget,
max_num_seqs and free blocks allow. When a running sequence cannot grow, the newest running
sequence is preempted: its blocks are freed (they keep their hashes, so the recompute usually
hits the prefix cache) and it goes back to the head of the waiting queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def request_ids_computing_last_token(self) -> list[str]:
        """Requests whose every token is computed once this step ran: a prompt's final chunk,
        or a decode step (the prefill worker sends a prompt's KV as its final chunk computes)."""
        return [
            seq.request_id
            for seq, num_new in zip(self.seqs, self.num_new_tokens)
            if seq.num_computed_tokens + num_new == seq.num_tokens
        ]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int] = (),
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0

    # ---- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

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
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            preempted_self = False
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                break
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            idx += 1
        if batch.preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_blocks(seq)
            num_new = min(seq.num_tokens - len(cached) * self.kv.block_size, budget)
            if not self.kv.allocate_prompt(seq, cached, num_new):
                break
            self.waiting.popleft()
            if seq.queue_seconds is None:
                seq.queue_seconds = time.monotonic() - seq.arrival_time
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, batch: ScheduledBatch, sampled: dict[str, tuple]) -> list[Sequence]:
        """Advance computed counts, cache full blocks, append sampled tokens, stop finished
        sequences. Returns the sequences that received a token this step."""
        advanced = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_computed_prompt_tokens += min(num_new, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += num_new
            self.kv.cache_computed_blocks(seq)
            result = sampled.get(seq.request_id)
            if result is None:
                continue
            seq.append_token(*result)
            advanced.append(seq)
            if seq.prefill_only:
                self.running.remove(seq)
                seq.status = SequenceStatus.PREFILLED
                continue
            reason = self.check_stop(seq)
            if reason is not None:
                self.finish(seq, reason)
        return advanced

    def check_stop(self, seq: Sequence) -> str | None:
        """Token-level stop conditions; stop strings are checked by the output processor.
        Before min_tokens outputs neither EOS nor a stop token ends it (the sampler masks them)."""
        last = seq.token_ids[-1]
        if seq.num_output_tokens > seq.params.min_tokens:
            if last in seq.params.stop_token_ids:
                seq.stop_reason, seq.stopped_by_token = last, True
                return "stop"
            if not seq.params.ignore_eos and last in self.eos_token_ids:
                seq.stopped_by_token = True
                return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated:  # the output is complete
            return seq.grammar.finish_reason
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
