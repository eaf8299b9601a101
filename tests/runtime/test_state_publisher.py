"""StatePublisher over a real ReplicaChannelServer and real RequestChannelClients (sockets, no
Ray): a subscriber first gets the events after its own position, then every change in shared,
numbered frames; nothing changed -> nothing sent but a heartbeat; a late subscriber joins the
same numbering; a subscriber without events gets load alone at its own interval; a prefill
replica's channel (no on_submit) refuses requests."""

from __future__ import annotations

import asyncio
from collections import deque

import msgspec
import pytest

from splitserve.cluster.ingress.request_channel_client import ChannelClosed, RequestChannelClient
from splitserve.proto.messages.kv_events import STORED, KVEvent
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from splitserve.proto.messages.request_channel import ReplicaState, Submit
from splitserve.proto.messages.sampling_params import SamplingParams
from splitserve.runtime.replica_channel_server import ReplicaChannelServer
from splitserve.runtime.state_publisher import StatePublisher
from tests.helpers.engine_stats import STATS

pytestmark = pytest.mark.timeout(30)


class Replica:
    """What a worker hands the publisher: its state and its event log."""

    def __init__(self):
        self.log: deque[KVEvent] = deque(maxlen=8)
        self.state = PollReply(events=[], engine=STATS, num_pinned=0, num_active=0, transfer=TransferTotals())
        self.reads = 0

    def store(self, n: int) -> None:
        first = self.log[-1].seq + 1 if self.log else 1
        self.log.extend(KVEvent(seq, STORED, (seq,)) for seq in range(first, first + n))

    async def read_state(self) -> PollReply:
        self.reads += 1
        return self.state

    def events_after(self, seq: int | None) -> list[KVEvent]:
        return [e for e in self.log if seq is not None and e.seq > seq]


async def _frames(frames: list[ReplicaState], n: int) -> list[ReplicaState]:
    for _ in range(500):
        if len(frames) >= n:
            return frames
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(frames)} frames, expected {n}")


def test_subscribers_get_catch_up_then_shared_numbered_frames_on_change():
    async def go():
        replica = Replica()
        publisher = StatePublisher(replica.read_state, replica.events_after, interval_s=60, heartbeat_s=0.3)
        server = ReplicaChannelServer("prefill-0", None, None, None, publisher.subscribe)
        address = await server.start("127.0.0.1")
        a, b, c = (RequestChannelClient("prefill-0", address, name) for name in ("a", "b", "controller"))
        got: dict[str, list[ReplicaState]] = {"a": [], "b": [], "c": []}
        replica.store(3)
        await a.subscribe(1, got["a"].append, lambda: None)
        [first] = await _frames(got["a"], 1)
        assert [e.seq for e in first.reply.events] == [2, 3]  # after its own position
        replica.store(2)
        await publisher.publish()
        second = (await _frames(got["a"], 2))[1]
        assert second.seq == first.seq + 1 and [e.seq for e in second.reply.events] == [4, 5]
        await publisher.publish()  # nothing changed: nothing sent
        await asyncio.sleep(0.1)
        assert len(got["a"]) == 2
        # A late subscriber from its snapshot's position; then both get the same frames.
        await b.subscribe(5, got["b"].append, lambda: None)
        await _frames(got["b"], 1)
        assert got["b"][0].reply.events == []
        replica.state = msgspec.structs.replace(replica.state, num_active=3)  # load changed, no event
        await publisher.publish()
        await _frames(got["a"], 3)
        await _frames(got["b"], 2)
        assert got["a"][2] == got["b"][1] and got["a"][2].seq == second.seq + 1
        assert got["a"][2].reply.num_active == 3
        # Silence is broken by a heartbeat.
        await asyncio.sleep(0.35)
        await publisher.publish()
        assert (await _frames(got["a"], 4))[3].seq == got["a"][2].seq + 1
        # Load only, every interval, whatever changed (the controller's subscription).
        await c.subscribe(0, got["c"].append, lambda: None, events=False, interval_s=0.05)
        for _ in range(500):  # the server has read the Subscribe
            if publisher.state_subscribers:
                break
            await asyncio.sleep(0.01)
        replica.store(1)
        await publisher.publish()
        [load] = await _frames(got["c"], 1)
        assert load.reply.events == [] and load.reply.num_active == 3
        assert [e.seq for e in (await _frames(got["a"], 5))[4].reply.events] == [6]
        # A prefill replica's channel takes no requests: the connection ends.
        lost = asyncio.Event()
        a.on_lost = lost.set
        queue = await a.submit(Submit("r", [1], SamplingParams()))
        assert isinstance(await asyncio.wait_for(queue.get(), 5), ChannelClosed)
        await asyncio.wait_for(lost.wait(), 5)
        for client in (a, b, c):
            await client.close()
        await publisher.stop()
        await server.close()

    asyncio.run(go())
