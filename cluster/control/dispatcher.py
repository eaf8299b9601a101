"""Dispatcher: one ingress's request path. Routes each request to a (prefill, decode) pair,
sends it over that decode replica's request channel (cluster/control/decode_channel.py),
streams its chunks back, retries on other replicas while nothing has streamed, aborts it at
its deadline or when its caller goes away -- and keeps this ingress's router current by
following every replica's KV events and load (poll with since_seq).

Which replicas exist is the controller's to say: a MembershipFollower applies its views here
(add_replica / drop_replica / set_draining); a replica found dead leaves routing at once (the
controller kills and replaces it, and tells its peers). Internal request ids are this dispatcher's own,
`<ingress id>-<n>`, unique across ingresses; a client's id is only a label, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import ray

from splitserve.cluster.control.decode_channel import ChannelClosed, DecodeChannel
from splitserve.cluster.control.membership import ReplicaInfo
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.router import DECODE, PREFILL, NoReplicaError, Router
from splitserve.engine.engine_errors import EngineLoopStopped
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.kvtransfer.handoff import StreamChunk
from splitserve.kvtransfer.poll_reply import PollReply
from splitserve.kvtransfer.request_channel import Failed, FailureKind, Submit

logger = logging.getLogger(__name__)
ACTOR_GONE = (ray.exceptions.RayActorError,)
# The replica called is dead: its actor died, or its engine loop stopped for good.
REPLICA_GONE = (EngineLoopStopped, *ACTOR_GONE)
_DEADLINE = object()  # queued by a request's deadline timer
# What a failure before the first token means: which replica a retry avoids, whether it uses
# up retry budget (a dead replica is not the request's fault), and the kind when giving up.
_RETRY: dict[FailureKind, tuple[str | None, bool, ErrorKind]] = {
    FailureKind.PREFILL_FAILED: (PREFILL, True, ErrorKind.INTERNAL),
    FailureKind.PREFILL_TIMEOUT: (PREFILL, True, ErrorKind.UNAVAILABLE),
    FailureKind.PREFILL_DEAD: (PREFILL, False, ErrorKind.UNAVAILABLE),
    FailureKind.BUSY: (DECODE, True, ErrorKind.UNAVAILABLE),
    FailureKind.REPLICA_DEAD: (DECODE, False, ErrorKind.UNAVAILABLE),
    FailureKind.INVALID: (None, True, ErrorKind.INVALID),
    FailureKind.STEP_FAILED: (None, True, ErrorKind.INTERNAL),
    FailureKind.INTERNAL: (None, True, ErrorKind.INTERNAL),
}


def deadline_exceeded(timeout_s: float) -> RequestError:
    """The request ran past its deadline; whatever it held on the replicas is freed."""
    return RequestError(
        ErrorKind.DEADLINE, f"the request did not finish before its deadline ({timeout_s:.1f} s after it started)"
    )


@dataclass
class Member:
    """A replica this ingress routes to: how to reach it."""

    info: ReplicaInfo
    handle: Any  # its actor handle (polls, snapshots)
    channel: DecodeChannel | None = None  # decode replicas: the request channel

    @property
    def replica_id(self) -> str:
        return self.info.replica_id

    @property
    def actor_id(self) -> str:
        return self.info.actor_id

    @property
    def draining(self) -> bool:
        return self.info.draining


class Dispatcher:
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
    ):
        self.router = router
        self.ingress_id = ingress_id or uuid.uuid4().hex[:8]
        self.max_retries = max_retries
        self.layerwise = layerwise
        self.lease_s = lease_s
        self.request_timeout_s = request_timeout_s
        self.poll_interval_s = poll_interval_s
        self.on_poll = on_poll
        self.on_drop = on_drop  # (pool, replica id) once a replica left routing, for any reason
        # pool -> replica id -> Member: what this ingress routes to.
        self.members: dict[str, dict[str, Member]] = {PREFILL: {}, DECODE: {}}
        self.inflight: dict[str, str] = {}  # request id -> decode replica id
        self.inflight_prefill: dict[str, str] = {}  # request id -> prefill replica id, until its first token
        self._ids = itertools.count(1)
        self._poller: asyncio.Task | None = None
        # Held while the router's view is read from the replicas (poll, add, rebuild), so a
        # rebuilt router never misses the events taken between a snapshot and the swap.
        self._membership = asyncio.Lock()
        self._closing: set[asyncio.Task] = set()
        # Actors found dead here before the controller's view dropped them: never re-added.
        self._dead_actors: set[str] = set()
        self.num_retries = 0

    # ---- replica membership --------------------------------------------------------------
    async def add_replica(self, info: ReplicaInfo, handle: Any = None) -> bool:
        """Index a ready replica from its snapshot, then route to it. handle: its actor handle
        (default: looked up by name in its namespace). False: its actor is gone (the
        controller's next view drops it)."""
        if info.actor_id and info.actor_id in self._dead_actors:
            return False
        if handle is None:
            try:
                handle = await asyncio.to_thread(ray.get_actor, info.replica_id, namespace=info.namespace)
            except ValueError:  # no such actor: it died
                return False
        channel = None
        if info.pool == DECODE:
            if info.channel_address is None:
                raise ValueError(f"decode replica {info.replica_id} has no request channel address")
            channel = DecodeChannel(info.replica_id, info.channel_address, self.ingress_id)
        async with self._membership:
            try:
                snapshot = await asyncio.wait_for(handle.snapshot.remote(), 30)
            except ACTOR_GONE:
                if channel is not None:
                    self._close_channel(channel)
                return False
            if info.replica_id in self.router.replica_ids(info.pool):  # a rebuild or an older add got it
                self.router.resync(info.pool, info.replica_id, snapshot)
            else:
                self.router.add_replica(info.pool, info.replica_id, snapshot)
            self.router.set_draining(info.pool, info.replica_id, info.draining)
            old = self.members[info.pool].get(info.replica_id)
            self.members[info.pool][info.replica_id] = Member(info, handle, channel)
        if old is not None and old.channel is not None:
            self._close_channel(old.channel)
        return True

    def drop_replica(self, pool: str, replica_id: str) -> None:
        """Stop routing to a replica and forget it; its open requests fail (retryably if
        nothing streamed yet). Routing only: the controller kills replicas and tells peers."""
        self.router.remove_replica(pool, replica_id)
        member = self.members[pool].pop(replica_id, None)
        if member is not None and member.channel is not None:
            self._close_channel(member.channel)
        if member is not None and self.on_drop is not None:
            self.on_drop(pool, replica_id)

    def set_draining(self, pool: str, replica_id: str, draining: bool) -> None:
        member = self.members[pool].get(replica_id)
        if member is not None:
            member.info = msgspec.structs.replace(member.info, draining=draining)
            self.router.set_draining(pool, replica_id, draining)

    def replica_ids(self, pool: str) -> list[str]:
        return list(self.members[pool])

    def replica_infos(self) -> dict[tuple[str, str], Member]:
        """(pool, replica id) -> Member, for every replica routed here (the follower diffs it)."""
        return {(pool, rid): m for pool, members in self.members.items() for rid, m in members.items()}

    def _close_channel(self, channel: DecodeChannel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _drop_dead(self, pool: str, replica_id: str, why: str) -> None:
        """A replica found dead here leaves routing at once, before the controller notices
        (it replaces the replica; a stale view cannot bring this actor back)."""
        logger.warning("%s replica %s %s; dropping it from routing", pool, replica_id, why)
        member = self.members[pool].get(replica_id)
        if member is not None and member.actor_id:
            self._dead_actors.add(member.actor_id)
        self.drop_replica(pool, replica_id)

    async def rebuild_router(self, make_router: Callable[[], Router]) -> Router:
        """Swap in a fresh router indexed from every live replica's snapshot (a router
        restart), while requests keep flowing. Polling pauses until the swap, so events taken
        afterwards continue each replica's snapshot (older ones are skipped as duplicates).
        A replica that died meanwhile is dropped; draining flags carry over."""
        async with self._membership:
            router = make_router()
            live = [(pool, m) for pool, members in self.members.items() for m in list(members.values())]
            snapshots = await asyncio.gather(
                *(asyncio.wait_for(m.handle.snapshot.remote(), 30) for _, m in live), return_exceptions=True
            )
            for (pool, member), snapshot in zip(live, snapshots):
                rid = member.info.replica_id
                if isinstance(snapshot, REPLICA_GONE):  # its actor or its engine loop is dead
                    self._drop_dead(pool, rid, "is dead")
                elif isinstance(snapshot, BaseException):
                    raise RequestError(
                        ErrorKind.UNAVAILABLE,
                        f"cannot rebuild the router: snapshot of {rid} failed: {_short(snapshot)}",
                    )
                elif rid in self.members[pool]:  # not removed meanwhile
                    router.add_replica(pool, rid, snapshot)
                    router.set_draining(pool, rid, self.members[pool][rid].info.draining)
            self.router = router  # no await since the checks above: atomic on the event loop
            logger.info("router rebuilt from %d replica snapshots", len(live))
            return router

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

    # ---- following the replicas: KV events and load ----------------------------------------
    async def poll_once(self) -> None:
        async with self._membership:
            tasks = [
                self._poll_replica(pool, member)
                for pool, members in self.members.items()
                for member in list(members.values())
                if member.info.replica_id in self.router.replica_ids(pool)
            ]
            if tasks:
                await asyncio.gather(*tasks)

    async def _poll_replica(self, pool: str, member: Member) -> None:
        rid = member.info.replica_id
        since = self.router.index(pool).last_seq(rid)
        try:
            poll = PollReply.from_bytes(await asyncio.wait_for(member.handle.poll.remote(since), 10))
        except ACTOR_GONE:
            self._drop_dead(pool, rid, "died")
            return
        except (TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning("polling %s failed: %r", rid, exc)
            return
        if rid not in self.members[pool]:  # dropped while we waited
            return
        if not poll.is_serving:  # it reported itself dead: out of routing now, once
            self._drop_dead(pool, rid, f"stopped serving ({poll.error})")
            return
        if not self.router.apply_events(pool, rid, poll.events):
            if rid in self.router.replicas_needing_resync(pool):  # fell behind its event log
                self.router.resync(pool, rid, await asyncio.wait_for(member.handle.snapshot.remote(), 10))
        self.router.update_load(pool, rid, LoadReport.from_poll(poll))
        if self.on_poll is not None:
            self.on_poll(pool, rid, poll)

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:
                logger.exception("replica poll failed")
            await asyncio.sleep(self.poll_interval_s)

    def start_polling(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None

    async def close(self) -> None:
        """Stop polling and close every request channel."""
        await self.stop_polling()
        for members in self.members.values():
            for member in members.values():
                if member.channel is not None:
                    await member.channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

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
    ) -> AsyncIterator[StreamChunk]:
        """Stream a request's chunks. Retries (at most max_retries times, on other replicas)
        only while no chunk has reached the caller; raises RequestError (kind DEADLINE once
        `deadline` (time.time(); default now + request_timeout_s) passes). However it ends --
        finished, failed, deadline, or the caller closing this generator -- the replicas free
        whatever the request held. label: the client's own id, only logged."""
        base_id = self.new_request_id()
        deadline = deadline or time.time() + self.request_timeout_s
        timeout_s = deadline - time.time()
        exclude = {PREFILL: set(), DECODE: set()}
        attempt = num_budgeted = 0
        sampling = params.to_dict()
        while True:
            if time.time() >= deadline:
                raise deadline_exceeded(timeout_s)
            try:
                decision = self.router.route(
                    prompt_token_ids, exclude_prefill=exclude[PREFILL], exclude_decode=exclude[DECODE]
                )
            except NoReplicaError as exc:
                raise RequestError(ErrorKind.UNAVAILABLE, str(exc)) from None
            decode = self.members[DECODE].get(decision.decode_replica)
            prefill_id = decision.prefill_replica
            if decode is None:  # dropped since the router last heard of it
                exclude[DECODE].add(decision.decode_replica)
                continue
            if prefill_id is not None and prefill_id not in self.members[PREFILL]:
                exclude[PREFILL].add(prefill_id)
                continue
            if on_route is not None:
                on_route(decision)
            request_id = f"{base_id}.{attempt}" if attempt else base_id
            submit = Submit(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=sampling,
                prefill_replica_id=prefill_id,
                label=label or "",
                deadline=deadline,
                lease_s=self.lease_s,
                layerwise=self.layerwise,
            )
            outcome: list = []  # the failure that ended the attempt, if one did
            # aclosing: when our caller closes us mid-stream, the attempt's clean-up (Abort)
            # runs now, not whenever the garbage collector finalizes it.
            async with contextlib.aclosing(self._attempt(decode, submit, timeout_s, outcome)) as chunks:
                async for chunk in chunks:
                    yield chunk
            if not outcome:
                return
            failure, sent_any = outcome
            if isinstance(failure, Failed):
                avoid, costs_budget, give_up_kind = _RETRY[failure.kind]
                retryable, message = failure.retryable and avoid is not None, failure.message
            else:  # the channel to the decode replica broke: it died, most likely
                avoid, costs_budget, give_up_kind = DECODE, False, ErrorKind.UNAVAILABLE
                retryable, message = True, str(failure)
            if time.time() >= deadline:
                raise deadline_exceeded(timeout_s)
            # Never after a chunk reached the caller: a retry cannot resume it exactly.
            if sent_any or not retryable or (costs_budget and num_budgeted >= self.max_retries):
                logger.info("request %s (client id %r) failed: %s", request_id, label, message)
                if give_up_kind is ErrorKind.INVALID:
                    raise RequestError(give_up_kind, message)
                raise RequestError(give_up_kind, f"request failed: {message}")
            attempt += 1
            num_budgeted += costs_budget
            self.num_retries += 1
            exclude[avoid].add(prefill_id if avoid == PREFILL else decode.info.replica_id)
            logger.warning("retrying %s (client id %r, attempt %d) after: %s", base_id, label, attempt, message)

    async def _attempt(self, decode: Member, submit: Submit, timeout_s: float, outcome: list):
        """One try on one decode replica: yields its chunks; on a failure, appends
        (Failed | ChannelClosed, whether a chunk was yielded) to outcome and returns."""
        rid = submit.request_id
        channel = decode.channel
        self.inflight[rid] = decode.info.replica_id
        if submit.prefill_replica_id is not None:
            self.inflight_prefill[rid] = submit.prefill_replica_id
        sent_any = done = False
        timer = None
        try:
            try:
                queue = await channel.submit(submit)
            except ChannelClosed as exc:
                outcome.extend((exc, False))
                return
            loop = asyncio.get_running_loop()
            timer = loop.call_later(max(submit.deadline - time.time(), 0), queue.put_nowait, _DEADLINE)
            while True:
                item = await queue.get()
                if type(item) is StreamChunk:
                    if not sent_any:
                        sent_any = True
                        self.inflight_prefill.pop(rid, None)
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
            if timer is not None:
                timer.cancel()
            self.inflight.pop(rid, None)
            self.inflight_prefill.pop(rid, None)
            if not done:
                channel.abort(rid)  # a no-op if it failed on the replica: nothing left there


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
