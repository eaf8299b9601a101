"""KVHandoff: the engine's side of the prefill -> decode KV handoff, a part of PagedEngine.

Prefill: a prefill-only request's blocks stay pinned after its first token until
release_prefilled; prompt_block_ids says which local blocks to send. Decode: reserve the
prompt's blocks (reusing cached ones) before its KV arrives, then admit the request with the
prefill replica's first token, or release the reservation.

With an early first token (accept_first_token) the first output leaves before the KV lands;
the sequence stays reserved, in no batch, until admit_prefilled.

Mixed into PagedEngine, whose state it uses: kv (KVCacheManager), scheduler, _reserved, _early
(reserved requests whose first token was taken early), and abort / _forget / _emit_output.
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
        self._early.discard(request_id)
        seq = self._reserved.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def accept_first_token(self, request_id: str, first: PrefillResult) -> RequestOutput | None:
        """An early first token: the prefill replica's result before its KV has landed. Take the
        token (as admit_prefilled would) and return its output now, while the sequence waits,
        reserved and out of every batch, for admit_prefilled once the KV is in. None, taking
        nothing, where the request is no longer reserved here or this token could end it (a
        stop token, EOS, max_tokens, the context, a grammar or a stop string): its one output
        then comes from admit_prefilled, once its blocks can be released."""
        seq = self._reserved.get(request_id)
        if seq is None or request_id in self._early or self._first_token_may_end(seq, first.first_token):
            return None
        if not self._prompt_logprobs_fit(seq, first):
            return None  # admit_prefilled fails it, once no transfer writes into its blocks
        self._take_first_token(seq, first)
        self._early.add(request_id)
        return self._emit_output(seq)

    def _first_token_may_end(self, seq: Sequence, token: int) -> bool:
        """Whether check_stop or the output processor could finish seq at this first token (a
        superset: a False here is never wrong)."""
        params, sched = seq.params, self.scheduler
        return bool(
            params.stop
            or seq.grammar is not None
            or params.max_tokens <= 1
            or token in params.stop_token_ids
            or token in sched.eos_token_ids
            or seq.num_tokens + 1 >= sched.max_model_len
        )

    def admit_prefilled(self, request_id: str, first: PrefillResult) -> RequestOutput | None:
        """The reserved prompt's KV is in place: append the first token (sampled by the prefill
        replica, with its top alternatives when asked for), check the stop conditions, join the
        running batch, and return the first output, post-processed exactly like a step's
        (None where accept_first_token returned it already: the sequence only joins).
        first: the prefill replica's result, whole: the first token (its logprob and top
        alternatives), the cached prompt tokens, the queue time, and for a request with
        SamplingParams.prompt_logprobs the prompt's log-probabilities, alternatives and ranks."""
        seq = self._reserved[request_id]
        early = request_id in self._early
        reason = None
        if not early:
            self._take_first_token(seq, first)
            reason = check_stop(self.scheduler, seq)
        self.scheduler.add_prefilled(seq)  # also enters its received full blocks into the cache
        del self._reserved[request_id]  # only now: until here, abort() still frees its blocks
        self._early.discard(request_id)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return None if early else self._emit_output(seq)

    def _take_first_token(self, seq: Sequence, first: PrefillResult) -> None:
        """Append the prefill replica's first token (and what rides with it) to a reserved seq."""
        request_id, first_token = seq.request_id, first.first_token
        self._check_prompt_logprobs(seq, first)
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

    def _check_prompt_logprobs(self, seq: Sequence, first: PrefillResult) -> None:
        """The prefill replica's prompt log-probabilities cover the prompt (and its top
        alternatives, when asked); else the reservation is freed and the request fails."""
        if not self._prompt_logprobs_fit(seq, first):
            self.release_reservation(seq.request_id)
            raise RuntimeError(
                f"the prefill replica sent {len(first.prompt_logprobs or ())} prompt log-probabilities for a "
                f"{seq.num_prompt_tokens}-token prompt; is it running an older splitserve?"
            )

    @staticmethod
    def _prompt_logprobs_fit(seq: Sequence, first: PrefillResult) -> bool:
        if seq.params.prompt_logprobs is None:
            return True
        num = seq.num_prompt_tokens - 1
        num_top = num if seq.params.prompt_logprobs else 0
        sizes = (len(first.prompt_logprobs or ()), len(first.prompt_top_logprobs or ()), len(first.prompt_ranks or ()))
        return sizes == (num, num_top, num)

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
