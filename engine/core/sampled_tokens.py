"""What a finished step's sampled tokens do to its sequences (Scheduler.update), and the
token-level stop conditions each appended token is checked against.

Apart from the scheduler's choice of a batch because it is the other half of a step: the
scheduler decides what runs, this applies what came back (computed counts, cached blocks,
appended tokens, grammar, stops, the draft slots given back).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from splitserve.engine.core.scheduled_batch import ScheduledBatch
from splitserve.engine.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from splitserve.engine.core.scheduler import Scheduler

logger = logging.getLogger(__name__)


def apply_sampled(
    sched: Scheduler, batch: ScheduledBatch, sampled: dict[str, tuple[Any, ...] | list[tuple[Any, ...]]]
) -> list[Sequence]:
    """Advance computed counts, cache full blocks, append sampled tokens, stop finished
    sequences. Returns the sequences that received a token this step.

    sampled maps a request id to its token (token, logprob, top logprobs), or, for a
    sequence that verified a draft, the list of tokens it emits: the accepted draft tokens
    and one more. They are appended one by one, each advancing the grammar and checked
    against the stop conditions; a stop drops the rest. Only the accepted tokens' KV
    counts as computed, and the slots reserved past them are given back."""
    advanced = []
    committed = batch.starts is not None
    starts = batch.starts or []
    for index, (seq, num_new, num_draft) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens)):
        if seq.status is not SequenceStatus.RUNNING:
            continue  # aborted or preempted while the step ran
        if committed:  # async scheduling: its computed count moved when it was submitted
            if seq.num_preemptions != batch.preemptions[index]:
                continue  # preempted (maybe readmitted) since: it recomputes
            start = starts[index]
            seq.num_output_placeholders -= batch.placeholders[index]
        else:
            start = seq.num_computed_tokens
        num_real = num_new - num_draft
        if start < seq.num_prompt_tokens:
            sched.num_computed_prompt_tokens += min(num_real, seq.num_prompt_tokens - start)
        result = sampled.get(seq.request_id)
        tokens = result if isinstance(result, list) else [] if result is None else [result]
        reason = None
        for token in tokens:
            seq.append_token(*token)
            _advance_grammar(seq, token[0])
            if not seq.prefill_only:
                reason = check_stop(sched, seq)
                if reason is not None:
                    break
        if committed:  # only the KV this batch wrote: a later step may still be running
            written = start + num_real
            sched.kv.cache_computed_blocks(seq, written)
        else:
            # The real tokens' KV, and each accepted draft token's (the last emitted token is new).
            n = seq.num_computed_tokens + num_real + max(len(tokens) - 1, 0)
            seq.num_computed_tokens = written = min(n, seq.num_tokens)
            sched.kv.cache_computed_blocks(seq)
        if not seq.prefill_only:
            # Sliding windows: no later query (a step in flight's included: its queries
            # start at `written`) sees the blocks wholly before written's window.
            sched.kv.free_dead_blocks(seq, written)
        if not tokens:
            continue
        advanced.append(seq)
        if seq.prefill_only:
            sched.running.remove(seq)
            seq.status = SequenceStatus.PREFILLED
        elif reason is not None:
            sched.finish(seq, reason)
        elif not committed:
            sched.kv.trim_slots(seq)  # slots reserved for rejected (or unproposed) drafts go back
    return advanced


def _advance_grammar(seq: Sequence, token: int) -> None:
    if seq.grammar is not None and not seq.grammar.accept_token(token):
        # The mask forbids such tokens; the matcher is now failed and the request
        # finishes with "abort" instead of claiming a valid output.
        logger.error("grammar rejected sampled token %d of %s: %s", token, seq.request_id, seq.grammar.error)


def check_stop(sched: Scheduler, seq: Sequence) -> str | None:
    """Token-level stop conditions (the scheduler's EOS ids and context length); stop strings
    are checked by the output processor. Before min_tokens outputs neither EOS nor a stop
    token ends it (the sampler masks them)."""
    last = seq.token_ids[-1]
    if seq.num_output_tokens > seq.params.min_tokens:
        if last in seq.params.stop_token_ids:
            seq.stop_reason, seq.stopped_by_token = last, True
            return "stop"
        if not seq.params.ignore_eos and last in sched.eos_token_ids:
            seq.stopped_by_token = True
            return "stop"
    if seq.grammar is not None and seq.grammar.is_terminated:  # the output is complete
        return seq.grammar.finish_reason
    if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= sched.max_model_len:
        return "length"
    return None
