"""KVHandoff: the engine's side of the prefill -> decode KV handoff, a part of PagedEngine.

Prefill: a prefill-only request's blocks stay pinned after its first token until
release_prefilled; prompt_block_ids says which local blocks to send. Decode: reserve the
prompt's blocks (reusing cached ones) before its KV arrives, then admit the request with the
prefill replica's first token, or release the reservation.

Mixed into PagedEngine, whose state it uses: kv (KVCacheManager), scheduler, _reserved, and
abort / _forget / _emit_output.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.engine.core.sampled_tokens import check_stop
from splitserve.engine.core.sequence import Sequence, SequenceStatus
from splitserve.engine.io.block_reservation import BlockReservation
from splitserve.engine.io.request_output import RequestOutput
from splitserve.proto.messages.handoff import PrefillResult


class KVHandoff:
    def release_prefilled(self, request_id: str) -> None:
        """After the KV handoff: a prefilled request's blocks are unpinned (they stay in the
        prefix cache, evictable); a request that has not finished prefilling is aborted."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return
        if seq.status is SequenceStatus.PREFILLED:
            self.scheduler.release_prefilled(seq)
        else:
            self.abort(request_id)

    def prompt_block_ids(self, request_id: str, block_indices: Iterable[int]) -> list[int]:
        """The local block ids of a queued or running request's prompt blocks, by index."""
        seq = self.scheduler.requests[request_id]
        indices = list(block_indices)
        if indices and min(indices) < seq.num_skipped_blocks:
            raise ValueError(f"{request_id}: prompt block {min(indices)} is no longer held (outside its window)")
        return [seq.block_table[i] for i in indices]

    # ---- disaggregated decode: reserve blocks, receive the KV, admit ---------------------
    def reserve_prompt_blocks(self, seq: Sequence) -> BlockReservation | None:
        """Reuse every cached full block of seq's prompt and allocate the rest, before its KV
        arrives from a prefill replica. Returns the prompt blocks still to receive and where
        they go, or None (holding nothing) if blocks are short. The blocks stay reserved until
        admit_prefilled, release_reservation or abort."""
        if seq.request_id in self._reserved:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        kv = self.kv
        cached = kv.find_cached_blocks(seq, max_tokens=seq.num_prompt_tokens)
        num_new = seq.num_prompt_tokens - len(cached) * kv.block_size
        # Its first query here is past the prompt: blocks no query from there sees (a sliding
        # window's) are neither reserved nor received.
        if not kv.allocate_prompt(seq, cached, num_new, next_query=seq.num_prompt_tokens):
            return None
        self._reserved[seq.request_id] = seq
        first = max(len(cached), seq.num_skipped_blocks)
        pairs = sorted(((i, seq.block_table[i]) for i in range(first, len(seq.block_table))), key=lambda p: p[1])
        return BlockReservation([i for i, _ in pairs], [b for _, b in pairs])

    def release_reservation(self, request_id: str) -> None:
        """Free a reservation's blocks (its transfer failed or was abandoned). Unknown ids are ignored."""
        seq = self._reserved.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def admit_prefilled(self, request_id: str, first: PrefillResult) -> RequestOutput:
        """The reserved prompt's KV is in place: append the first token (sampled by the prefill
        replica, with its top alternatives when asked for), check the stop conditions, join the
        running batch, and return the first output, post-processed exactly like a step's.
        first: the prefill replica's result, whole: the first token (its logprob and top
        alternatives), the cached prompt tokens, the queue time, and for a request with
        SamplingParams.prompt_logprobs the prompt's log-probabilities, alternatives and ranks."""
        seq = self._reserved[request_id]
        first_token = first.first_token
        if seq.params.prompt_logprobs is not None:
            self._check_prompt_logprobs(seq, first.prompt_logprobs, first.prompt_top_logprobs, first.prompt_ranks)
        # A constrained request's grammar state crosses as the tokens the prefill replica
        # accepted (the first token): replay it into this replica's matcher.
        if seq.grammar is not None and not seq.grammar.accept_token(first_token):
            error = seq.grammar.error.strip()
            self.release_reservation(request_id)
            raise RuntimeError(
                f"the prefill replica's first token {first_token} breaks the request's grammar ({error}); "
                "is it running an older splitserve?"
            )
        if seq.params.prompt_logprobs is not None:
            seq.add_prompt_logprobs(
                [float(lp) for lp in first.prompt_logprobs],
                [[(int(t), float(lp)) for t, lp in top] for top in first.prompt_top_logprobs],
                [int(rank) for rank in first.prompt_ranks],
            )
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = first.num_cached_tokens
        seq.queue_seconds = first.queue_seconds
        top = [(int(t), float(lp)) for t, lp in first.first_top_logprobs] if seq.params.top_logprobs else None
        seq.append_token(first_token, first.first_logprob if seq.params.logprobs else None, top)
        reason = check_stop(self.scheduler, seq)
        self.scheduler.add_prefilled(seq)  # also enters its received full blocks into the cache
        del self._reserved[request_id]  # only now: until here, abort() still frees its blocks
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._emit_output(seq)

    def _check_prompt_logprobs(self, seq: Sequence, logprobs, top_logprobs, ranks) -> None:
        """The prefill replica's prompt log-probabilities cover the prompt (and its top
        alternatives, when asked); else the reservation is freed and the request fails."""
        num = seq.num_prompt_tokens - 1
        num_top = num if seq.params.prompt_logprobs else 0
        if len(logprobs or ()) != num or len(top_logprobs or ()) != num_top or len(ranks or ()) != num:
            self.release_reservation(seq.request_id)
            raise RuntimeError(
                f"the prefill replica sent {len(logprobs or ())} prompt log-probabilities for a "
                f"{seq.num_prompt_tokens}-token prompt; is it running an older splitserve?"
            )

    def _prefilled_output(self, seq: Sequence) -> RequestOutput:
        """A prefill-only request's one output: its first token, no text (decode detokenizes)."""
        self._forget(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[seq.token_ids[-1]],
            new_text="",
            token_ids=[seq.token_ids[-1]],
            text="",
            finished=True,
            finish_reason="prefilled",
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=list(seq.output_logprobs),
            logprobs=list(seq.output_logprobs),
            new_top_logprobs=list(seq.output_top_logprobs),
            top_logprobs=list(seq.output_top_logprobs),
            prompt_logprobs=seq.prompt_logprobs,
            prompt_top_logprobs=seq.prompt_top_logprobs,
            prompt_ranks=seq.prompt_ranks,
            queue_seconds=seq.queue_seconds,
        )
