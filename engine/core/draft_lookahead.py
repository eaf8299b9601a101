"""Speculative decoding's slots: the draft tokens a decoding sequence may verify in a step,
reserved last (Scheduler.schedule), from the token budget and free blocks the running and
newly admitted sequences left, so speculation never preempts a sequence or delays an admission.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.engine.core.scheduled_batch import ScheduledBatch
from splitserve.engine.core.sequence import Sequence

if TYPE_CHECKING:
    from splitserve.engine.core.scheduler import Scheduler


def reserve_lookahead(sched: Scheduler, batch: ScheduledBatch, lookahead: dict[str, int], budget: int) -> None:
    """lookahead: request id -> draft tokens asked; budget: the step's token budget left."""
    for index, seq in enumerate(batch.seqs):
        if budget <= 0:
            return
        num_draft = _num_lookahead(sched, seq, lookahead.get(seq.request_id, 0), batch.num_new_tokens[index], budget)
        if num_draft and sched.kv.allocate_slots(seq, 1 + num_draft):
            batch.num_new_tokens[index] += num_draft
            batch.num_draft_tokens[index] = num_draft
            budget -= num_draft


def _num_lookahead(sched: Scheduler, seq: Sequence, asked: int, num_new: int, budget: int) -> int:
    """Draft tokens seq may verify this step: what was asked, within the token budget, the
    context length and what is left of max_tokens (a draft past the end is wasted)."""
    if asked <= 0 or num_new != 1 or seq.num_tokens - seq.num_computed_tokens != 1 or seq.prefill_only:
        return 0
    # The step emits up to num_draft + 1 tokens; none may pass max_tokens or the context.
    remaining = seq.params.max_tokens - seq.num_output_tokens - 1
    return max(0, min(asked, budget, sched.max_model_len - seq.num_tokens - 1, remaining))
