"""Dispatcher: one ingress's request path. Routes each request to a (prefill, decode) pair,
sends it over that decode replica's request channel (cluster/ingress/request_channel_client.py),
streams its chunks back, retries on other replicas while nothing has streamed, moves it to
another decode replica as a continuation when its own fails mid-stream (stream_migration.py;
what a failure before that means to a retry: attempt_failure.py),
aborts it at its deadline or when its caller goes away. Which replicas it routes to, and the router's view
of them (KV events, load), is its base class's: RoutedReplicas (routed_replicas.py).

Internal request ids are this dispatcher's own, `<ingress id>-<n>`, unique across ingresses; a
client's id is only a label, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Literal

import msgspec

from splitserve.cluster.ingress.attempt_failure import AttemptFailure
from splitserve.cluster.ingress.request_channel_client import ChannelClosed
from splitserve.cluster.ingress.routed_replicas import Member, RoutedReplicas
from splitserve.cluster.ingress.stream_migration import NO_REPLICA, AnswerSoFar, MigrationObserver, may_move
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.route_decision import RouteDecision
from splitserve.cluster.routing.router import NoHeadroomError, NoReplicaError, Router
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.request_channel import Submit
from splitserve.proto.messages.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_DEADLINE = object()  # queued by a request's deadline timer


def deadline_exceeded(timeout_s: float) -> RequestError:
    """The request ran past its deadline; whatever it held on the replicas is freed."""
    return RequestError(
        ErrorKind.DEADLINE, f"the request did not finish before its deadline ({timeout_s:.1f} s after it started)"
    )


class Dispatcher(RoutedReplicas):
    """One ingress's request path over the replicas it routes to (RoutedReplicas)."""

    def __init__(
        self,
        router: Router,
        ingress_id: str | None = None,
        max_retries: int = 1,
        layerwise: bool = True,
        lease_s: float = 20.0,
        request_timeout_s: float = 600.0,
        poll_interval_s: float = 0.1,
        on_poll: Callable[[str, str, PollReply], None] | None = None,
        on_drop: Callable[[str, str], None] | None = None,
        state_updates: Literal["push", "poll"] = "push",
        heartbeat_s: float = 1.0,
        max_migrations: int = 3,
        early_first_token: bool = False,
    ):
        super().__init__(
            router, ingress_id or uuid.uuid4().hex[:8], poll_interval_s, on_poll, on_drop, state_updates, heartbeat_s
        )
        self.max_retries = max_retries
        self.max_migrations = max_migrations  # moves of one stream to another decode replica
        self.layerwise = layerwise
        self.early_first_token = early_first_token  # ClusterConfig.early_first_token
        self.lease_s = lease_s
        self.request_timeout_s = request_timeout_s
        self.inflight: dict[str, str] = {}  # request id -> decode replica id
        self.inflight_prefill: dict[str, str] = {}  # request id -> prefill replica id, until its first token
        self._ids = itertools.count(1)
        self.num_retries = 0
        self.num_migrations = 0

    def num_inflight(self, pool: str, replica_id: str) -> int:
        """Requests sent to a replica that still need it: on decode until they finish, on
        prefill until their first token (the KV has then been moved). Drain waits on it,
        which also covers a request routed there whose Submit has not reached the replica."""
        table = self.inflight if pool == DECODE else self.inflight_prefill
        return sum(1 for rid in list(table.values()) if rid == replica_id)

    def inflight_counts(self) -> dict[str, int]:
        """replica id -> num_inflight, for every replica with requests (both pools): the
        ingress reports it to the controller, whose drain waits on every ingress."""
        counts: dict[str, int] = {}
        for table in (self.inflight, self.inflight_prefill):
            for replica_id in list(table.values()):
                counts[replica_id] = counts.get(replica_id, 0) + 1
        return counts

    # ---- requests ------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"{self.ingress_id}-{next(self._ids)}"

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        label: str | None = None,
        deadline: float | None = None,
        on_route: Callable | None = None,
        exclude_decode: Iterable[str] = (),
        sheddable: bool = False,
        migrations: MigrationObserver | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Stream a request's chunks (never on the decode replicas in exclude_decode; sheddable
        batch work only where the router's batch headroom admits it, else OVERLOADED). Retries (at most max_retries times, on other replicas)
        only while no chunk has reached the caller; raises RequestError (kind DEADLINE once
        `deadline` (time.time(); default now + request_timeout_s) passes). However it ends --
        finished, failed, deadline, or the caller closing this generator -- the replicas free
        whatever the request held. label: the client's own id, only logged. Once a chunk
        reached the caller, a decode replica's failure moves the request (at most
        max_migrations times, unless params.migration is off) as a continuation of the same
        stream; migrations counts the moves and refusals."""
        started = time.perf_counter()  # the first token's routing stage starts (first_token_stages)
        base_id = self.new_request_id()
        deadline = deadline or time.time() + self.request_timeout_s
        timeout_s = deadline - time.time()
        exclude = {PREFILL: set(), DECODE: set(exclude_decode)}
        attempt = num_budgeted = 0
        answer = AnswerSoFar(prompt_token_ids, params, migrations)
        moved_after = ""  # the failure the stream last moved after
        while True:
            if time.time() >= deadline:
                raise deadline_exceeded(timeout_s)
            try:
                decision = self.router.route(
                    prompt_token_ids,
                    exclude_prefill=exclude[PREFILL],
                    exclude_decode=exclude[DECODE],
                    sheddable=sheddable,
                    lora_adapter=params.lora_adapter,
                )
            except NoHeadroomError as exc:
                raise RequestError(ErrorKind.OVERLOADED, str(exc), retry_after_s=1.0) from None
            except NoReplicaError as exc:
                if not answer.num_moves:
                    raise RequestError(ErrorKind.UNAVAILABLE, str(exc)) from None
                if migrations is not None:
                    migrations.refused(NO_REPLICA)
                # The stream ends as it did before migration, with why it could not move.
                raise RequestError(ErrorKind.UNAVAILABLE, f"request failed: {moved_after}; {exc}") from None
            decode = self.members[DECODE].get(decision.decode_replica)
            prefill_id = decision.prefill_replica
            if decode is None:  # dropped since the router last heard of it
                decision.release_claims()
                exclude[DECODE].add(decision.decode_replica)
                continue
            if prefill_id is not None and prefill_id not in self.members[PREFILL]:
                decision.release_claims()
                exclude[PREFILL].add(prefill_id)
                continue
            if on_route is not None:
                on_route(decision)
            request_id = f"{base_id}.{attempt}" if attempt else base_id
            submit = Submit(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=params,
                prefill_replica_id=prefill_id,
                label=label or "",
                deadline=deadline,
                lease_s=self.lease_s,
                layerwise=self.layerwise,
                # Only where a failed transfer after the first token can move the stream.
                early_first_token=self.early_first_token and params.migration and self.max_migrations > 0,
            )
            outcome: list = []  # the failure that ended the attempt, if one did
            # aclosing: when our caller closes us mid-stream, the attempt's clean-up (Abort)
            # runs now, not whenever the garbage collector finalizes it.
            async with contextlib.aclosing(
                self._attempt(decode, submit, decision, timeout_s, outcome, started)
            ) as chunks:
                async for chunk in chunks:
                    yield answer.client_chunk(chunk)
            if not outcome:
                return
            failure, sent_any = outcome
            verdict = AttemptFailure.of(failure)
            message = verdict.message
            if time.time() >= deadline:
                raise deadline_exceeded(timeout_s)
            if sent_any and may_move(failure, params, answer, self.max_migrations, migrations):
                # The stream goes on from another decode replica: the same answer, continued.
                prompt_token_ids, params = answer.continuation()
                moved_after = message
                attempt += 1
                self.num_migrations += 1
                # Its KV transfer failed (an early first token): another prefill replica, or a
                # local prefill, on any decode replica; else another decode replica.
                if verdict.avoid == PREFILL and prefill_id is not None:
                    exclude[PREFILL].add(prefill_id)
                else:
                    exclude[DECODE].add(decode.info.replica_id)
                logger.warning("moving %s (client id %r) to another replica after: %s", base_id, label, message)
                continue
            # Never after a chunk reached the caller without a move: a retry cannot resume it.
            if sent_any or not verdict.retryable or (verdict.costs_budget and num_budgeted >= self.max_retries):
                logger.info("request %s (client id %r) failed: %s", request_id, label, message)
                if verdict.give_up_kind is ErrorKind.INVALID:
                    raise RequestError(verdict.give_up_kind, message)
                raise RequestError(verdict.give_up_kind, f"request failed: {message}")
            attempt += 1
            num_budgeted += verdict.costs_budget
            self.num_retries += 1
            exclude[verdict.avoid].add(prefill_id if verdict.avoid == PREFILL else decode.info.replica_id)
            logger.warning("retrying %s (client id %r, attempt %d) after: %s", base_id, label, attempt, message)

    async def _attempt(
        self, decode: Member, submit: Submit, decision: RouteDecision, timeout_s: float, outcome: list, started: float
    ):
        """One try on one decode replica: yields its chunks; on a failure, appends
        (Failed | ChannelClosed, whether a chunk was yielded) to outcome and returns. The
        decision's load claims are released as the request leaves each replica. The first
        chunk gains the routing and relay stages (_with_ingress_stages)."""
        rid = submit.request_id
        channel = decode.channel
        self.inflight[rid] = decode.info.replica_id
        kv_moving = submit.prefill_replica_id is not None
        if kv_moving:
            self.inflight_prefill[rid] = submit.prefill_replica_id
        sent_any = done = False
        timer = None
        try:
            submitted = time.perf_counter()
            try:
                queue = await channel.submit(submit)
            except ChannelClosed as exc:
                outcome.extend((exc, False))
                return
            loop = asyncio.get_running_loop()
            timer = loop.call_later(max(submit.deadline - time.time(), 0), queue.put_nowait, _DEADLINE)
            held = None
            while True:
                item, held = (held, None) if held is not None else (await queue.get(), None)
                if type(item) is StreamChunk:
                    # Several engine steps queued (this ingress fell behind the replica): one
                    # chunk for all of them, as vLLM's output collector merges, so a busy
                    # ingress renders and writes fewer events instead of falling further behind.
                    while not item.finished and not queue.empty():
                        later = queue.get_nowait()
                        if type(later) is not StreamChunk:
                            held = later
                            break
                        item = item.followed_by(later)
                    if not sent_any:
                        item = _with_ingress_stages(item, submitted - started, time.perf_counter() - submitted)
                        sent_any = True
                        decision.release_prefill()
                    if kv_moving and (not submit.early_first_token or item.finished or item.num_output_tokens > 1):
                        # The KV has moved (an early first token comes before it does): a drain
                        # of the prefill replica no longer waits for this request.
                        kv_moving = False
                        self.inflight_prefill.pop(rid, None)
                    if item.first_token_stages:
                        handoff = item.first_token_stages.get("handoff")
                        if handoff is not None and not decision.local_prefill:
                            self.router.observe_remote_handoff(handoff)
                    done = item.finished
                    yield item
                    if done:
                        return
                elif item is _DEADLINE:
                    raise deadline_exceeded(timeout_s)
                else:
                    outcome.extend((item, sent_any))
                    return
        finally:
            decision.release_claims()
            if timer is not None:
                timer.cancel()
            self.inflight.pop(rid, None)
            self.inflight_prefill.pop(rid, None)
            if not done:
                channel.abort(rid)  # a no-op if it failed on the replica: nothing left there


def _with_ingress_stages(chunk: StreamChunk, routing_s: float, round_trip_s: float) -> StreamChunk:
    """The first chunk with the dispatcher's stages added to the decode replica's: routing, from
    the request reaching generate() to its Submit leaving (earlier failed attempts included),
    and relay, the round trip less the decode replica's own time."""
    if chunk.replica_seconds is None:
        return chunk
    relay_s = max(round_trip_s - chunk.replica_seconds, 0.0)
    stages = {**chunk.first_token_stages, "routing": routing_s, "relay": relay_s}
    return msgspec.structs.replace(chunk, first_token_stages=stages)
