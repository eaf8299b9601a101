"""Migration: a stream that outlives its decode replica. When the replica streaming a request
fails mid-stream (its channel closed, its engine loop stopped, or a step failed; or the KV
transfer behind an early first token failed), the
dispatcher re-submits the request as a continuation: the prompt followed by every token the
client already has, max_tokens and min_tokens reduced by what was sent, and a Continuation
(proto/messages/continuation.py) telling the new replica how much of that is output and how
much of its text the client was sent. It is routed like any request (the KV router finds the
replica holding most of it; prefill with a KV transfer or locally), and its chunks go on
into the same client stream, rewritten to the client's counts.

AnswerSoFar is that bookkeeping, torch-free and Ray-free; the dispatcher owns the loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from splitserve.cluster.ingress.request_channel_client import ChannelClosed
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.proto.messages.continuation import Continuation
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.request_channel import Failed, FailureKind
from splitserve.proto.messages.sampling_params import SamplingParams

PREFILL_FAILED = "prefill_failed"
# The failures a continuation can outlive: the replica, not the request, went wrong.
_MOVABLE = {
    FailureKind.REPLICA_DEAD: "replica_dead",
    FailureKind.STEP_FAILED: "step_failed",
    FailureKind.REPLICA_DRAINING: "drain",  # a planned move: the replica leaves (scale-down, rollout)
    # An early first token (ClusterConfig.early_first_token) streams before its KV lands: a
    # transfer that then fails, times out or loses its prefill replica moves the stream.
    FailureKind.PREFILL_FAILED: PREFILL_FAILED,
    FailureKind.PREFILL_TIMEOUT: PREFILL_FAILED,
    FailureKind.PREFILL_DEAD: PREFILL_FAILED,
}
CHANNEL_CLOSED = "channel_closed"
# Why a movable stream was not moved (splitserve_migrations_refused_total{reason}).
DISABLED, MAX_ATTEMPTS, NO_REPLICA = "disabled", "max_attempts", "no_replica"


class MigrationObserver(Protocol):
    """Counts moves and refusals, times the gap the client saw, and counts the tokens each
    continuation's replica computed again (the ingress's metrics)."""

    def moved(self, pool: str, reason: str, num_tokens: int) -> None: ...

    def refused(self, reason: str) -> None: ...

    def gap(self, seconds: float) -> None: ...

    def recomputed(self, num_tokens: int) -> None: ...


def may_move(
    failure: Failed | ChannelClosed,
    params: SamplingParams,
    answer: AnswerSoFar,
    max_migrations: int,
    migrations: MigrationObserver | None,
) -> bool:
    """Whether a mid-stream failure moves the stream: a movable one, while params.migration is on
    and fewer than max_migrations moves were made. Counts the move, or why not."""
    reason = movable_reason(failure)
    if reason is None:
        return False  # the request itself failed, not its replica
    refused = DISABLED if not params.migration else MAX_ATTEMPTS if answer.num_moves >= max_migrations else None
    if migrations is not None:
        if refused is None:
            migrations.moved(PREFILL if reason == PREFILL_FAILED else DECODE, reason, len(answer.token_ids))
        else:
            migrations.refused(refused)
    return refused is None


def movable_reason(failure: Failed | ChannelClosed | BaseException) -> str | None:
    """Why a failure after the first chunk may be migrated (a metrics label), or None."""
    if isinstance(failure, Failed):
        return _MOVABLE.get(failure.kind)
    return CHANNEL_CLOSED if isinstance(failure, ChannelClosed) else None


class AnswerSoFar:
    """One request's answer as the client has it, across the replicas that produced it."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        observer: MigrationObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """observer: told the gap of each move, from the last token the client got before the
        failure to the first one after (clock: monotonic seconds), and how many of the
        continuation's prompt tokens its replica computed (found in no prefix cache or host tier)."""
        self.prompt_token_ids, self.params = prompt_token_ids, params
        self.observer, self.clock = observer, clock
        self._last_token_at: float | None = None
        self._moved_at: float | None = None  # the last token before the latest move, until the first after
        self.token_ids: list[int] = []  # every output token the client was sent
        self.num_text_chars = 0  # characters of text the client was sent
        self.num_moves = 0
        self._resumed = 0  # output tokens at the end of the current attempt's prompt
        self._continued = False  # a continuation was submitted; its first chunk not yet seen
        self._num_cached_tokens: int | None = None  # the first attempt's, what the client was told
        self._request_id = ""  # the id the client's first chunk carried (gRPC echoes it)

    def client_chunk(self, chunk: StreamChunk) -> StreamChunk:
        """Record a chunk the client is about to get; a continuation's counts become the client's
        (its id and prompt tokens, every output token so far, the first attempt's cached tokens)."""
        if chunk.token_ids:
            now = self.clock()
            if self._moved_at is not None:
                if self.observer is not None:
                    self.observer.gap(now - self._moved_at)
                self._moved_at = None
            self._last_token_at = now
        self.token_ids.extend(chunk.token_ids)
        self.num_text_chars += len(chunk.text)
        if self._num_cached_tokens is None:
            self._num_cached_tokens, self._request_id = chunk.num_cached_tokens, chunk.request_id
        if self._continued:  # every chunk carries its attempt's prompt and cache hit; count once
            self._continued = False
            if self.observer is not None:
                self.observer.recomputed(chunk.num_prompt_tokens - chunk.num_cached_tokens)
        if not self._resumed:
            return chunk
        return msgspec.structs.replace(
            chunk,
            request_id=self._request_id,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=chunk.num_output_tokens + self._resumed,
            num_cached_tokens=self._num_cached_tokens,
            queue_seconds=None,
        )

    def continuation(self) -> tuple[list[int], SamplingParams]:
        """The next attempt's prompt and parameters: the prompt and the answer so far, the
        limits reduced by what was sent; prompt log-probabilities were sent once already."""
        resumed = len(self.token_ids)
        params = msgspec.structs.replace(
            self.params,
            max_tokens=self.params.max_tokens - resumed,
            min_tokens=max(self.params.min_tokens - resumed, 0),
            prompt_logprobs=None,
            continuation=Continuation(resumed, self.num_text_chars),
        )
        self._resumed = resumed
        self._continued = True
        self.num_moves += 1
        if self._moved_at is None:  # a move before any token came back counts from the one before
            self._moved_at = self._last_token_at
        return self.prompt_token_ids + self.token_ids, params
