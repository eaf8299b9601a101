"""StatePublisher: pushes a replica's KV events and load to every ingress subscribed on its
request channel (ReplicaState frames, proto/messages/request_channel.py), instead of each
ingress polling each replica.

Every push interval it reads the engine's state once (one call into the engine loop, however
many ingresses follow it) and, if anything changed -- new KV events, or a load or health
figure -- encodes one frame and writes the same bytes to every subscriber. With nothing
changed it still sends a heartbeat every heartbeat_s, so a replica that stops pushing is
noticed. Frames are numbered (one counter per replica); a subscriber too far behind to take
one (runtime/replica_channel_server.py: MAX_STATE_BACKLOG_BYTES) is skipped and sees the
numbers jump, and resyncs from a snapshot. A new subscriber first gets the events after its
own position still in the replica's event log, then the shared frames. A subscriber that asked
for no events (the controller) gets the load and health alone, every interval it asked for.

Torch-free and Ray-free: it runs on the actor's event loop and reads the worker through two
callables.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from splitserve.proto.messages.kv_events import KVEvent
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.request_channel import ReplicaState, Subscribe, encode_frame
from splitserve.runtime.replica_channel_server import IngressConnection

logger = logging.getLogger(__name__)


class StatePublisher:
    def __init__(
        self,
        read_state: Callable[[], Awaitable[PollReply]],
        events_after: Callable[[int | None], list[KVEvent]],
        interval_s: float = 0.1,
        heartbeat_s: float = 1.0,
    ):
        """read_state(): the replica's PollReply without events, having moved the engine's new
        KV events into the worker's log; events_after(seq): the log's events after seq."""
        self.read_state, self.events_after = read_state, events_after
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self.subscribers: set[IngressConnection] = set()
        # Subscribers without events -> (their interval, when their next frame is due).
        self.state_subscribers: dict[IngressConnection, tuple[float, float]] = {}
        self.seq = 0  # the last frame's number
        self._pushed_seq = 0  # the last KV event pushed to every subscriber
        self._last: PollReply | None = None  # the load and health last pushed
        self._last_at = 0.0
        self._lock = asyncio.Lock()  # one frame at a time, and a subscription between frames
        self._task: asyncio.Task | None = None
        self.num_frames = 0  # frames encoded (each written to every subscriber)
        self.num_skipped = 0  # frames not written to a subscriber that had fallen behind
        self.frames_to_skip = 0  # chaos testing (EngineWorker.inject_fault): frames nobody gets

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="state-publisher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def subscribe(self, conn: IngressConnection, request: Subscribe) -> None:
        """The channel server's on_subscribe: conn gets its catch-up frame, then every frame
        (or, without events, a frame every request.interval_s)."""
        self.start()
        if not request.events:
            interval = max(request.interval_s, self.interval_s)
            self.state_subscribers[conn] = (interval, 0.0)  # due now
            self.subscribers.discard(conn)
            return
        self.state_subscribers.pop(conn, None)
        asyncio.get_running_loop().create_task(self._subscribe(conn, request.since_seq))

    async def _subscribe(self, conn: IngressConnection, since_seq: int) -> None:
        async with self._lock:
            self.subscribers.discard(conn)
            state = await self._publish_locked(force=False)  # the others first: nobody misses an event
            if conn.closed or not conn.subscribed:
                return
            catch_up = msgspec.structs.replace(state, events=self.events_after(since_seq))
            # Its own first frame carries the current number: the next shared one is +1.
            if not conn.send_state(encode_frame(ReplicaState(self.seq, catch_up))):
                self.num_skipped += 1
            self.subscribers.add(conn)

    async def publish(self, force: bool = False) -> None:
        """Push what changed since the last frame (force: a frame even if nothing did)."""
        async with self._lock:
            await self._publish_locked(force)

    async def _publish_locked(self, force: bool) -> PollReply:
        state = await self.read_state()
        events = self.events_after(self._pushed_seq)
        if events:
            self._pushed_seq = events[-1].seq
        self.subscribers = {c for c in self.subscribers if c.subscribed and not c.closed}
        now = time.monotonic()
        self._push_state_only(state, now)
        if not self.subscribers:
            self._last = None
            return state
        if force or events or state != self._last or now - self._last_at >= self.heartbeat_s:
            self.seq += 1
            self.num_frames += 1
            frame = encode_frame(ReplicaState(self.seq, msgspec.structs.replace(state, events=events)))
            skip, self.frames_to_skip = self.frames_to_skip > 0, max(self.frames_to_skip - 1, 0)
            for conn in self.subscribers:
                if skip or not conn.send_state(frame):
                    self.num_skipped += 1
            self._last, self._last_at = state, now
        return state

    def push_state_now(self, state: PollReply) -> None:
        """Load and health to every subscriber without events at once, without reading the
        engine (a SIGTERM'd replica tells the controller while a step may hold its loop)."""
        frame = encode_frame(ReplicaState(self.seq, state))
        for conn in list(self.state_subscribers):
            if not conn.closed and conn.subscribed and not conn.send_state(frame):
                self.num_skipped += 1

    def _push_state_only(self, state: PollReply, now: float) -> None:
        """Load and health to each subscriber without events whose interval is up."""
        frame = None
        for conn, (interval, due) in list(self.state_subscribers.items()):
            if conn.closed or not conn.subscribed:
                del self.state_subscribers[conn]
            elif now >= due:
                frame = frame or encode_frame(ReplicaState(self.seq, state))
                if not conn.send_state(frame):
                    self.num_skipped += 1
                self.state_subscribers[conn] = (interval, now + interval)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not (self.subscribers or self.state_subscribers):
                continue
            try:
                await self.publish()
            except Exception:  # a failed read must not stop the pushes (a stopped loop is a state)
                logger.exception("pushing replica state failed")
