"""RoutedReplicas: the replicas one ingress routes to, and its router's view of them.

Which replicas exist is the controller's to say: a MembershipFollower applies its views here
(add_replica / drop_replica / set_draining); a replica found dead leaves routing at once (the
controller kills and replaces it, and tells its peers). Each replica's KV events and load are
followed from this router's own position in its event log, so every ingress's router makes
the same prefix decision: pushed by the replica over this ingress's request channel to it
(state_updates "push", the default: PushedState, pushed_state.py), or polled every
poll_interval_s (poll(since_seq), "poll"). The Dispatcher (dispatcher.py) adds the request
path on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import ray

from splitserve.cluster.ingress.pushed_state import PushedState
from splitserve.cluster.ingress.request_channel_client import RequestChannelClient
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.engine.engine_errors import EngineLoopStopped
from splitserve.proto.messages.membership import ReplicaInfo
from splitserve.proto.messages.poll_reply import PollReply

logger = logging.getLogger(__name__)
ACTOR_GONE = (ray.exceptions.RayActorError,)
# The replica called is dead: its actor died, or its engine loop stopped for good.
REPLICA_GONE = (EngineLoopStopped, *ACTOR_GONE)


@dataclass
class Member:
    """A replica this ingress routes to: how to reach it."""

    info: ReplicaInfo
    handle: Any  # its actor handle (polls, snapshots)
    channel: RequestChannelClient | None = None  # its request channel (requests on decode; pushed state)
    frame_seq: int | None = None  # the last pushed frame's number (None: none since subscribing)
    last_state_at: float = 0.0  # time.monotonic() of its last pushed frame (or subscription)
    pending: list[PollReply] = field(default_factory=list)  # pushed while the view was read, or it resynced
    needs_resync: bool = False  # frames were lost: the next one applied brings a snapshot
    resyncing: bool = False

    @property
    def replica_id(self) -> str:
        return self.info.replica_id

    @property
    def actor_id(self) -> str:
        return self.info.actor_id

    @property
    def draining(self) -> bool:
        return self.info.draining


class RoutedReplicas:
    def __init__(
        self,
        router: Router,
        ingress_id: str,
        poll_interval_s: float = 0.1,
        on_poll: Callable[[str, str, PollReply], None] | None = None,
        on_drop: Callable[[str, str], None] | None = None,
        state_updates: Literal["push", "poll"] = "push",
        heartbeat_s: float = 1.0,
    ):
        self.router = router
        self.ingress_id = ingress_id
        self.poll_interval_s = poll_interval_s
        self.on_poll = on_poll  # (pool, replica id, PollReply) for every reply applied, polled or pushed
        self.on_drop = on_drop  # (pool, replica id) once a replica left routing, for any reason
        self.state_updates = state_updates
        # pool -> replica id -> Member: what this ingress routes to.
        self.members: dict[str, dict[str, Member]] = {PREFILL: {}, DECODE: {}}
        self.pushed = PushedState(self, heartbeat_s)
        self.following = False
        self._follower: asyncio.Task | None = None  # the poll loop, or the push watchdog
        # Held while the router's view is read from the replicas (poll, add, rebuild), so a
        # rebuilt router never misses the events taken between a snapshot and the swap.
        self._membership = asyncio.Lock()
        self._closing: set[asyncio.Task] = set()
        # Actors found dead here before the controller's view dropped them: never re-added.
        self._dead_actors: set[str] = set()

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
        if info.channel_address is not None:
            channel = RequestChannelClient(info.replica_id, info.channel_address, self.ingress_id)
        elif info.pool == DECODE:
            raise ValueError(f"decode replica {info.replica_id} has no request channel address")
        async with self.reading_view():
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
            member = self.members[info.pool][info.replica_id] = Member(info, handle, channel)
        if old is not None and old.channel is not None:
            self._close_channel(old.channel)
        if self.following and self.state_updates == "push":
            await self.pushed.subscribe(info.pool, member)
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

    def _close_channel(self, channel: RequestChannelClient) -> None:
        task = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def drop_dead(self, pool: str, replica_id: str, why: str) -> None:
        """A replica found dead here leaves routing at once, before the controller notices
        (it replaces the replica; a stale view cannot bring this actor back)."""
        logger.warning("%s replica %s %s; dropping it from routing", pool, replica_id, why)
        member = self.members[pool].get(replica_id)
        if member is not None and member.actor_id:
            self._dead_actors.add(member.actor_id)
        self.drop_replica(pool, replica_id)

    async def rebuild_router(self, make_router: Callable[[], Router]) -> Router:
        """Swap in a fresh router indexed from every live replica's snapshot (a router
        restart), while requests keep flowing. Following pauses until the swap (pushed frames
        wait), so events taken afterwards continue each replica's snapshot (older ones are skipped as duplicates).
        A replica that died meanwhile is dropped; draining flags carry over."""
        async with self.reading_view():
            router = make_router()
            live = [(pool, m) for pool, members in self.members.items() for m in list(members.values())]
            snapshots = await asyncio.gather(
                *(asyncio.wait_for(m.handle.snapshot.remote(), 30) for _, m in live), return_exceptions=True
            )
            for (pool, member), snapshot in zip(live, snapshots):
                rid = member.info.replica_id
                if isinstance(snapshot, REPLICA_GONE):  # its actor or its engine loop is dead
                    self.drop_dead(pool, rid, "is dead")
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

    # ---- following the replicas: KV events and load ----------------------------------------
    def start_following(self) -> None:
        """Follow every replica's KV events and load: pushed over its channel (state_updates
        "push", with a watchdog that subscribes and falls back to a poll when pushes stop), or
        polled every poll_interval_s ("poll")."""
        if self._follower is None:
            self.following = True
            run = self._poll_forever() if self.state_updates == "poll" else self.pushed.watch_forever()
            self._follower = asyncio.get_running_loop().create_task(run)

    async def stop_following(self) -> None:
        """Stop applying replicas' state (routing keeps the last view); pushes are unsubscribed."""
        self.following = False
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None
        self.pushed.unsubscribe_all()

    @contextlib.asynccontextmanager
    async def reading_view(self):
        """Held while the router's view is read from the replicas (poll, add, rebuild): pushed
        frames arriving meanwhile wait, then apply in order (older events are duplicates)."""
        async with self._membership:
            yield
        self.pushed.flush_all()

    def reading_view_now(self) -> bool:
        return self._membership.locked()

    async def poll_once(self) -> None:
        async with self.reading_view():
            tasks = [
                self.poll_replica(pool, member)
                for pool, members in self.members.items()
                for member in list(members.values())
                if member.info.replica_id in self.router.replica_ids(pool)
            ]
            if tasks:
                await asyncio.gather(*tasks)

    async def poll_replica(self, pool: str, member: Member) -> None:
        """One poll() of a replica (the "poll" mode's round, and push's fallback): its events
        after this router's position, its load, or that it died."""
        rid = member.info.replica_id
        since = self.router.index(pool).last_seq(rid) if rid in self.router.replica_ids(pool) else None
        try:
            poll = PollReply.from_bytes(await asyncio.wait_for(member.handle.poll.remote(since), 10))
        except ACTOR_GONE:
            self.drop_dead(pool, rid, "died")
            return
        except (TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning("polling %s failed: %r", rid, exc)
            return
        if self.members[pool].get(rid) is not member:  # dropped while we waited
            return
        await self.apply_state(pool, member, poll)

    async def apply_state(self, pool: str, member: Member, reply: PollReply) -> None:
        """Apply a polled reply: events, load, or that it stopped; a replica whose index
        needs it is resynced from one snapshot (pushed frames wait meanwhile)."""
        if not self.apply_now(pool, member, reply) and not member.resyncing:
            member.resyncing = True
            await self.pushed.resync(pool, member)

    def apply_now(self, pool: str, member: Member, reply: PollReply, resync: bool = False) -> bool:
        """The synchronous part of apply_state; False: the replica's index needs a snapshot."""
        rid = member.info.replica_id
        if self.members[pool].get(rid) is not member or rid not in self.router.replica_ids(pool):
            return True
        if not reply.is_serving:  # it reported itself dead: out of routing now, once
            self.drop_dead(pool, rid, f"stopped serving ({reply.error})")
            return True
        applied = self.router.apply_events(pool, rid, reply.events)
        self.router.update_load(pool, rid, LoadReport.from_poll(reply))
        if self.on_poll is not None:
            self.on_poll(pool, rid, reply)
        return not resync and (applied or rid not in self.router.replicas_needing_resync(pool))

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:
                logger.exception("replica poll failed")
            await asyncio.sleep(self.poll_interval_s)

    async def close(self) -> None:
        """Stop following and close every request channel."""
        await self.stop_following()
        for task in self.pushed.tasks:  # resyncs and fallback polls: nobody needs them now
            task.cancel()
        for members in self.members.values():
            for member in members.values():
                if member.channel is not None:
                    await member.channel.close()
        await asyncio.gather(*self._closing, *self.pushed.tasks, return_exceptions=True)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
