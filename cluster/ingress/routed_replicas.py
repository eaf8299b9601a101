"""RoutedReplicas: the replicas one ingress routes to, and its router's view of them.

Which replicas exist is the controller's to say: a MembershipFollower applies its views here
(add_replica / drop_replica / set_draining); a replica found dead leaves routing at once (the
controller kills and replaces it, and tells its peers). Each replica's KV events and load are
followed by polling it from this router's own position in its event log (poll(since_seq)), so
every ingress's router makes the same prefix decision. The Dispatcher (dispatcher.py) adds the
request path on top.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import ray

from splitserve.cluster.ingress.request_channel_client import RequestChannelClient
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.router import DECODE, PREFILL, Router
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
    channel: RequestChannelClient | None = None  # decode replicas: the request channel

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
    ):
        self.router = router
        self.ingress_id = ingress_id
        self.poll_interval_s = poll_interval_s
        self.on_poll = on_poll
        self.on_drop = on_drop  # (pool, replica id) once a replica left routing, for any reason
        # pool -> replica id -> Member: what this ingress routes to.
        self.members: dict[str, dict[str, Member]] = {PREFILL: {}, DECODE: {}}
        self._poller: asyncio.Task | None = None
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
        if info.pool == DECODE:
            if info.channel_address is None:
                raise ValueError(f"decode replica {info.replica_id} has no request channel address")
            channel = RequestChannelClient(info.replica_id, info.channel_address, self.ingress_id)
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

    def _close_channel(self, channel: RequestChannelClient) -> None:
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


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
