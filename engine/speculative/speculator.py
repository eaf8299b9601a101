"""Speculator: the engine's side of speculative decoding, around each step.

1. lookahead(running): the policy picks k for each decoding sequence that has not opted out,
   the proposer drafts up to k tokens, and the draft lengths go to the scheduler, which
   reserves KV slots for them from what is left after everything else (Scheduler.schedule).
2. fill(batch): each scheduled sequence's draft, cut to the slots it got and, for a
   constrained request, to the prefix its grammar allows, goes into the batch; the model
   runner then scores all of it in one forward pass next to the plain decodes.
3. record(batch, sampled, seconds): acceptance and step cost go to the policy, and the
   counts to the engine's stats (proposed, accepted, emitted tokens; drafts; chosen k).

Proposers: n-gram prompt lookup (torch-free; drafts before scheduling, so only drafts that
exist reserve slots) or a draft model (spec/draft_model_proposer.py; drafts after scheduling,
for the sequences that got slots). This module imports no torch itself.
"""

from __future__ import annotations

from typing import Any

from splitserve.engine.core.scheduler import ScheduledBatch
from splitserve.engine.core.sequence import Sequence, SequenceStatus
from splitserve.engine.speculative.ngram_proposer import NgramProposer
from splitserve.engine.speculative.speculation_policy import SpeculationPolicy
from splitserve.engine.speculative.speculative_config import SpeculativeConfig


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft_proposer: Any = None):
        """draft_proposer: a DraftModelProposer for method "draft" (the engine builds it: it
        loads a model)."""
        if config.method == "draft" and draft_proposer is None:
            raise ValueError("speculative method 'draft' needs a draft model proposer")
        self.config = config
        self.method = config.method
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_proposer = draft_proposer if config.method == "draft" else None
        self.policy = SpeculationPolicy(config)
        self._drafts: dict[str, list[int]] = {}
        self._lookahead: dict[str, int] = {}
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0  # by steps that verified a draft, the bonus token included
        self.num_drafts = 0
        # k_histogram[k]: decoding sequence-steps for which the policy chose k (0: no speculation).
        self.k_histogram = [0] * (config.num_speculative_tokens + 1)

    @classmethod
    def for_engine(cls, engine_config, vocab_size: int) -> Speculator | None:
        """The engine's speculator (None when it does not speculate); method "draft" loads
        the draft model, checked against the served model's vocabulary size."""
        config = engine_config.speculative
        if not config.enabled:
            return None
        draft = None
        if config.method == "draft":
            from splitserve.engine.speculative.draft_model_proposer import DraftModelProposer  # torch

            draft = DraftModelProposer(config.draft_model, engine_config, vocab_size)
        return cls(config, draft)

    @staticmethod
    def is_decoding(seq: Sequence) -> bool:
        return (
            seq.status is SequenceStatus.RUNNING
            and not seq.prefill_only
            and seq.num_tokens - seq.num_computed_tokens == 1
            and seq.params.speculative_decoding
        )

    def lookahead(self, running: list[Sequence]) -> dict[str, int]:
        """Request id -> draft length, for the running sequences worth speculating on."""
        self._drafts.clear()
        self._lookahead.clear()
        decoding = [seq for seq in running if self.is_decoding(seq)]
        if not decoding:
            return {}
        chosen = self.policy.choose([seq.request_id for seq in decoding])
        for seq in decoding:
            k = chosen[seq.request_id]
            self.k_histogram[k] += 1
            if k and self.draft_proposer is not None:
                self._lookahead[seq.request_id] = k  # the draft model drafts once slots are reserved
            elif k:
                draft = self.proposer.propose(seq.token_ids, k)
                if draft:
                    self._drafts[seq.request_id] = draft
                    self._lookahead[seq.request_id] = len(draft)
        return dict(self._lookahead)

    def fill(self, batch: ScheduledBatch) -> None:
        """Put the drafts into the batch, each cut to its reserved slots and its grammar."""
        slotted = [(i, seq) for i, seq in enumerate(batch.seqs) if batch.num_draft_tokens[i]]
        probs: list = [None] * len(slotted)
        if self.draft_proposer is not None and slotted:
            drafts, probs = self.draft_proposer.propose(
                [seq for _, seq in slotted], [batch.num_draft_tokens[i] for i, _ in slotted]
            )
        else:
            drafts = [self._drafts.get(seq.request_id, [])[: batch.num_draft_tokens[i]] for i, seq in slotted]
        for (index, seq), draft, q in zip(slotted, drafts, probs):
            if seq.grammar is not None and draft:
                draft = draft[: seq.grammar.num_valid_tokens(draft)]
            batch.set_draft(index, draft, q)
        self._drafts.clear()
        self._lookahead.clear()

    def record(self, batch: ScheduledBatch, sampled: dict, seconds: float) -> None:
        """After the step: each verified draft's acceptance, and the step's cost when it was
        all decodes (a prompt chunk would make it no measure of the verify cost)."""
        for request_id, draft in batch.draft_token_ids.items():
            emitted = sampled.get(request_id)
            if not isinstance(emitted, list):
                continue
            num_accepted = len(emitted) - 1
            self.policy.record_draft(request_id, len(draft), num_accepted)
            if self.draft_proposer is not None:
                self.draft_proposer.record(request_id, num_accepted)
            self.num_drafts += 1
            self.num_proposed_tokens += len(draft)
            self.num_accepted_tokens += num_accepted
            self.num_emitted_tokens += len(emitted)
        if all(n - d == 1 for n, d in zip(batch.num_new_tokens, batch.num_draft_tokens)):
            self.policy.record_step(batch.num_tokens, seconds, verifies=bool(batch.draft_token_ids))

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        if self.draft_proposer is not None:
            self.draft_proposer.forget(request_id)

    def stats(self) -> dict:
        return {
            "spec_method": self.method,
            "spec_num_drafts": self.num_drafts,
            "spec_proposed_tokens": self.num_proposed_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_emitted_tokens": self.num_emitted_tokens,
            "spec_k_histogram": list(self.k_histogram),
        }
