"""ScheduledBatch: one step's sequences and how many tokens each computes (the scheduler's
output, the runner's input)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.core.sequence import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    # Per sequence: tokens this step computes, draft tokens included.
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Speculative decoding: per sequence, how many of its new tokens are draft tokens (after
    # its last real token); their ids by request id. The scheduler reserves slots for the
    # lookahead it was given; the speculator then fills in the drafts it found (maybe fewer).
    num_draft_tokens: list[int] = field(default_factory=list)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # A draft model's distributions its draft tokens were sampled from (request id -> a
    # [k, vocab] tensor; opaque here), for rejection sampling. Absent: a point mass (n-gram).
    draft_probs: dict[str, Any] = field(default_factory=dict)
    # Async scheduling (Scheduler.commit): set when the batch is submitted, its positions then
    # counted as computed. Per sequence: num_computed_tokens before the batch, num_preemptions
    # then (a sequence preempted since gets nothing from it), whether it holds a placeholder
    # for the token the batch samples. None for the synchronous step.
    starts: list[int] | None = None
    preemptions: list[int] = field(default_factory=list)
    placeholders: list[bool] = field(default_factory=list)
    # The LoRA adapters of the running sequences when the batch was scheduled: the device's
    # slots evict others first (engine/lora/lora_slots.py).
    running_adapters: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the rows that compute more than one token besides drafts: prompt chunks.
        A one-token prompt chunk (a fully cached prompt's last token) counts as a decode row:
        it costs one."""
        return sum(n for n, d in zip(self.num_new_tokens, self.num_draft_tokens) if n - d > 1)

    @property
    def is_fresh_prompt(self) -> bool:
        """One prompt's first chunk alone (no cached prefix, no other row): the step the CPU's
        scripted prefill runs (engine/model/prefill_graph.py), priced on its own line
        (engine/step_cost_profile.py). Before the scheduler's update (async: its commit)."""
        if len(self.seqs) != 1 or self.num_prefill_tokens == 0:
            return False
        start = self.starts[0] if self.starts is not None else self.seqs[0].num_computed_tokens
        return start == 0

    def set_draft(self, index: int, token_ids: list[int], probs: Any = None) -> None:
        """Sequence index's draft for this step (at most the lookahead scheduled for it), and
        the distributions it was sampled from when a draft model sampled it."""
        if len(token_ids) > self.num_draft_tokens[index]:
            raise ValueError(f"draft of {len(token_ids)} tokens, {self.num_draft_tokens[index]} slots reserved")
        self.num_new_tokens[index] -= self.num_draft_tokens[index] - len(token_ids)
        self.num_draft_tokens[index] = len(token_ids)
        seq = self.seqs[index]
        self.draft_probs.pop(seq.request_id, None)
        if token_ids:
            self.draft_token_ids[seq.request_id] = list(token_ids)
            if probs is not None:
                self.draft_probs[seq.request_id] = probs[: len(token_ids)]
        else:
            self.draft_token_ids.pop(seq.request_id, None)

    def request_ids_computing_last_token(self) -> list[str]:
        """Requests whose every token is computed once this step ran: a prompt's final chunk,
        or a decode step (the prefill worker sends a prompt's KV as its final chunk computes)."""
        return [
            seq.request_id
            for seq, num_new, num_draft in zip(self.seqs, self.num_new_tokens, self.num_draft_tokens)
            if seq.num_computed_tokens + num_new - num_draft == seq.num_tokens_with_placeholders
        ]
