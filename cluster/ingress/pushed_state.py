"""PushedState: how one ingress follows its replicas' pushed state (state_updates "push").

Each replica pushes ReplicaState frames (its KV events since its last frame, its load and
health) over the request channel this ingress keeps to it (runtime/state_publisher.py). Here:
- subscribe(): once a replica is indexed from its snapshot, ask it to push from the
  snapshot's sequence number on (it first sends the events after it still in its log);
- a frame is applied at once (RoutedReplicas.apply_now: events to the router's index, load,
  or out of routing if it stopped serving), or held while the view is read (a poll round, an
  add, a router rebuild) or while the replica resyncs, then applied in order;
- a jump in frame numbers (the replica skipped frames this ingress did not read in time) or a
  KV sequence gap -> one snapshot() call, then the held frames (older events are duplicates);
- the watchdog, every heartbeat: subscribes what is not subscribed, and polls once (poll(),
  the old path) a replica whose connection broke or that sent nothing for STALE_HEARTBEATS
  heartbeats -- a dead actor is dropped from routing there, as a poll always did. Which
  replicas exist is still the controller's view.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING

from splitserve.cluster.ingress.request_channel_client import ChannelClosed
from splitserve.proto.messages.request_channel import ReplicaState

if TYPE_CHECKING:
    from splitserve.cluster.ingress.routed_replicas import Member, RoutedReplicas

logger = logging.getLogger(__name__)
STALE_HEARTBEATS = 3  # heartbeats missed before a replica is polled instead
MAX_PENDING = 1000  # frames held per replica; past it they are dropped and it resyncs


class PushedState:
    def __init__(self, replicas: RoutedReplicas, heartbeat_s: float = 1.0):
        self.replicas = replicas
        self.heartbeat_s = heartbeat_s
        self.tasks: set[asyncio.Task] = set()
        self.num_frames = 0  # frames received while following
        self.num_resyncs = 0  # snapshots taken because frames or events were lost
        self.num_fallback_polls = 0  # polls of a replica whose pushes stopped

    # ---- subscriptions --------------------------------------------------------------------
    async def subscribe(self, pool: str, member: Member) -> bool:
        """Ask the replica to push its state from this router's position; False: unreachable."""
        router, rid, channel = self.replicas.router, member.info.replica_id, member.channel
        if channel is None or rid not in router.replica_ids(pool):
            return False
        member.frame_seq, member.last_state_at = None, time.monotonic()
        try:
            await channel.subscribe(
                router.index(pool).last_seq(rid),
                functools.partial(self._on_state, pool, member),
                functools.partial(self._on_lost, pool, member),
            )
        except ChannelClosed as exc:
            logger.info("cannot subscribe to %s's state yet: %s", rid, exc)
            return False
        return True

    def unsubscribe_all(self) -> None:
        for members in self.replicas.members.values():
            for member in members.values():
                if member.channel is not None:
                    member.channel.unsubscribe()

    # ---- frames ---------------------------------------------------------------------------
    def _on_state(self, pool: str, member: Member, frame: ReplicaState) -> None:
        replicas = self.replicas
        if not replicas.following or replicas.members[pool].get(member.info.replica_id) is not member:
            return
        self.num_frames += 1
        member.last_state_at = time.monotonic()
        if member.frame_seq is not None and frame.seq != member.frame_seq + 1:
            member.needs_resync = True  # the replica skipped frames we did not read in time
        member.frame_seq = frame.seq
        member.pending.append(frame.reply)
        if len(member.pending) > MAX_PENDING:  # held too long: the snapshot will cover them
            member.pending = [frame.reply]
            member.needs_resync = True
        if not (replicas.reading_view_now() or member.resyncing):
            self.flush(pool, member)

    def flush(self, pool: str, member: Member) -> None:
        """Apply the frames held for a replica, in order, until one needs a resync."""
        while member.pending and not member.resyncing:
            reply = member.pending.pop(0)
            resync, member.needs_resync = member.needs_resync, False
            if not self.replicas.apply_now(pool, member, reply, resync):
                member.resyncing = True  # before the task runs: later frames wait for the snapshot
                self._spawn(self.resync(pool, member))

    def flush_all(self) -> None:
        for pool, members in self.replicas.members.items():
            for member in list(members.values()):
                if member.pending:
                    self.flush(pool, member)

    async def resync(self, pool: str, member: Member) -> None:
        """One snapshot of the replica, then the frames held meanwhile (the caller has set
        member.resyncing, so frames arriving from then on wait)."""
        from splitserve.cluster.ingress.routed_replicas import REPLICA_GONE

        replicas, rid = self.replicas, member.info.replica_id
        try:
            snapshot = await asyncio.wait_for(member.handle.snapshot.remote(), 10)
            if replicas.members[pool].get(rid) is member and rid in replicas.router.replica_ids(pool):
                replicas.router.resync(pool, rid, snapshot)
                self.num_resyncs += 1
        except REPLICA_GONE:
            replicas.drop_dead(pool, rid, "is dead")
        except Exception as exc:  # a busy or unreachable replica: the next frame tries again
            logger.warning("resyncing %s failed: %r", rid, exc)
            member.needs_resync = True
        finally:
            member.resyncing = False
        if replicas.members[pool].get(rid) is member and not replicas.reading_view_now():
            self.flush(pool, member)  # else reading_view flushes when it ends

    def _on_lost(self, pool: str, member: Member) -> None:
        """The subscribed connection ended: poll once (is it dead?), then subscribe again."""
        self._spawn(self._check(pool, member))

    async def _check(self, pool: str, member: Member) -> None:
        # Not under the view lock: a hung replica must not hold every other replica's frames.
        replicas = self.replicas
        self.num_fallback_polls += 1
        await replicas.poll_replica(pool, member)
        if replicas.following and replicas.members[pool].get(member.info.replica_id) is member:
            await self.subscribe(pool, member)

    # ---- the watchdog ---------------------------------------------------------------------
    async def watch_forever(self) -> None:
        while True:
            try:
                await self.watch_once()
            except Exception:
                logger.exception("watching the replicas' pushed state failed")
            await asyncio.sleep(self.heartbeat_s)

    async def watch_once(self) -> None:
        """Subscribe every replica not subscribed; poll those whose pushes stopped."""
        stale_before = time.monotonic() - STALE_HEARTBEATS * self.heartbeat_s
        work = []
        for pool, members in self.replicas.members.items():
            for member in list(members.values()):
                if member.channel is None or member.resyncing:
                    continue
                if not member.channel.subscribed:
                    work.append(self._subscribe_or_poll(pool, member))
                elif member.last_state_at < stale_before:
                    logger.warning(
                        "%s replica %s pushed nothing for %.1f s; polling it",
                        pool,
                        member.info.replica_id,
                        time.monotonic() - member.last_state_at,
                    )
                    work.append(self._check(pool, member))
        if work:
            await asyncio.gather(*work)

    async def _subscribe_or_poll(self, pool: str, member: Member) -> None:
        if not await self.subscribe(pool, member):
            await self._check_without_subscribing(pool, member)

    async def _check_without_subscribing(self, pool: str, member: Member) -> None:
        self.num_fallback_polls += 1
        await self.replicas.poll_replica(pool, member)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
