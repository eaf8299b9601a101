"""ReplicaStateFeed: the controller's pushed view of every replica's load and health, in place
of one probe() Ray call per replica per probe interval.

The controller subscribes on each replica's request channel, like an ingress, but for load and
health alone (no KV events), one frame every probe_interval_s
(runtime/state_publisher.py). A round then reads the latest frame of each replica: a frame
that says the engine loop stopped is a dead replica (killed and replaced, as a probe
answering so); a replica with no fresh frame -- not subscribed yet, its connection broke (its
actor died?), or nothing for STALE_INTERVALS intervals -- is probed as before
(replica_probe.py), which is also how a dead actor is found. Drains still probe: their
answer must be current.
"""

from __future__ import annotations

import functools
import logging
import time

from splitserve.cluster.control.replica_probe import ProbeResult
from splitserve.cluster.control.worker_pool import Replica
from splitserve.cluster.ingress.request_channel_client import ChannelClosed, RequestChannelClient
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.request_channel import ReplicaState

logger = logging.getLogger(__name__)
STALE_INTERVALS = 3  # frames missed before a replica is probed instead


class ReplicaStateFeed:
    def __init__(self, controller_id: str, interval_s: float, heartbeat_s: float):
        self.controller_id = controller_id
        self.interval_s = interval_s
        self.stale_s = STALE_INTERVALS * max(interval_s, heartbeat_s)
        self.clients: dict[str, RequestChannelClient] = {}
        self.latest: dict[str, tuple[float, PollReply]] = {}  # replica id -> (when, its last frame)
        self.num_frames = 0

    async def result(self, replica: Replica) -> ProbeResult | None:
        """The replica's pushed load and health; None: none fresh (probe it instead)."""
        rid = replica.replica_id
        client = self.clients.get(rid)
        if client is None or client.address != _address(replica):
            if replica.channel_address is None:
                return None
            await self.forget(rid)
            client = self.clients[rid] = RequestChannelClient(rid, replica.channel_address, self.controller_id)
        if not client.subscribed:
            self.latest.pop(rid, None)
            try:
                await client.subscribe(
                    0, functools.partial(self._on_state, rid), lambda: None, events=False, interval_s=self.interval_s
                )
            except ChannelClosed:
                pass
            return None
        got = self.latest.get(rid)
        if got is None or time.monotonic() - got[0] > self.stale_s:
            return None
        reply = got[1]
        if not reply.is_serving:
            return ProbeResult(reply, dead=True, kill=True, reason=f"engine loop stopped: {reply.error}")
        return ProbeResult(reply)

    def _on_state(self, replica_id: str, frame: ReplicaState) -> None:
        self.num_frames += 1
        self.latest[replica_id] = (time.monotonic(), frame.reply)

    async def retain(self, replica_ids: set[str]) -> None:
        """Close the subscriptions of replicas that left."""
        for rid in [r for r in self.clients if r not in replica_ids]:
            await self.forget(rid)

    async def forget(self, replica_id: str) -> None:
        client = self.clients.pop(replica_id, None)
        self.latest.pop(replica_id, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        for rid in list(self.clients):
            await self.forget(rid)


def _address(replica: Replica) -> tuple[str, int] | None:
    address = replica.channel_address
    return (address[0], int(address[1])) if address is not None else None
