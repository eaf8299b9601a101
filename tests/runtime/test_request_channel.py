"""The decode request channel over real sockets, without Ray: frames round-trip, the handshake
refuses another version or the wrong replica, a closed connection fails every open request
(and the server learns which requests were open), and garbage never gets past the decoder."""

from __future__ import annotations

import asyncio
import struct
from collections import deque

import pytest

from splitserve.cluster.ingress.request_channel_client import ChannelClosed, RequestChannelClient
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.kv_events import STORED, KVEvent
from splitserve.proto.messages.request_channel import (
    CHANNEL_VERSION,
    MAX_FRAME_BYTES,
    Abort,
    ChannelError,
    Failed,
    FailureKind,
    Hello,
    Submit,
    TokenBatch,
    Welcome,
    decode_to_decode,
    decode_to_ingress,
    encode_frame,
    read_frame,
)
from splitserve.proto.messages.sampling_params import SamplingParams
from splitserve.runtime.engine_worker import EngineWorker
from splitserve.runtime.replica_channel_server import ReplicaChannelServer

pytestmark = pytest.mark.timeout(30)


def chunk(rid: str, token: int, finished: bool = False) -> StreamChunk:
    return StreamChunk(rid, [token], f"t{token}", finished, "length" if finished else None, 3, 0, 1)


def test_frames_round_trip_and_refuse_garbage():
    for msg in (Hello(1, "ing"), Submit("r", [1, 2], SamplingParams(max_tokens=2), "prefill-0", label="x"), Abort("r")):
        assert decode_to_decode(encode_frame(msg)[4:]) == msg
    batch = TokenBatch([chunk("a", 1), chunk("b", 2, True)])
    for msg in (Welcome(1, "decode-0"), batch, Failed("r", FailureKind.BUSY, True, "full")):
        assert decode_to_ingress(encode_frame(msg)[4:]) == msg
    with pytest.raises(ChannelError, match="malformed"):
        decode_to_decode(encode_frame(batch)[4:])  # a decode->ingress message sent the other way
    with pytest.raises(ChannelError, match="malformed"):
        decode_to_ingress(b"\xdd\xff\xff\xff\xff")  # an array header claiming 4G items

    async def oversized():
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack("!I", MAX_FRAME_BYTES + 1))
        await read_frame(reader)

    with pytest.raises(ChannelError, match="over the"):
        asyncio.run(oversized())


class Recorder:
    def __init__(self):
        self.submits: list[Submit] = []
        self.aborts: list[str] = []
        self.closed: list[set[str]] = []
        self.conns = []

    def server(self, replica_id: str = "decode-0") -> ReplicaChannelServer:
        def on_submit(conn, submit):
            self.conns.append(conn)
            conn.request_ids.add(submit.request_id)
            self.submits.append(submit)

        def on_abort(conn, rid):
            conn.request_ids.discard(rid)
            self.aborts.append(rid)

        return ReplicaChannelServer(
            replica_id, on_submit, on_abort, lambda conn: self.closed.append(set(conn.request_ids))
        )


async def _wait(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_submit_stream_abort_and_connection_loss():
    async def go():
        rec = Recorder()
        server = rec.server()
        address = await server.start("127.0.0.1")
        channel = RequestChannelClient("decode-0", address, "ingress-a")
        qa = await channel.submit(Submit("a", [1, 2, 3], SamplingParams()))
        qb = await channel.submit(Submit("b", [1, 2, 3], SamplingParams()))
        qc = await channel.submit(Submit("c", [1, 2, 3], SamplingParams()))
        await _wait(lambda: len(rec.submits) == 3)
        conn = rec.conns[0]
        assert conn.ingress_id == "ingress-a" and [s.request_id for s in rec.submits] == ["a", "b", "c"]
        # One frame carries a step's tokens of every request; a Failed ends one request.
        conn.send(encode_frame(TokenBatch([chunk("a", 1), chunk("b", 7, True)])))
        conn.send(encode_frame(Failed("c", FailureKind.PREFILL_FAILED, True, "prefill on prefill-1 failed")))
        conn.request_ids -= {"b", "c"}  # done on the worker's side (DecodeWorker forgets them)
        assert (await qa.get()).token_ids == [1] and (await qb.get()).finished
        failed = await qc.get()
        assert isinstance(failed, Failed) and failed.retryable and failed.kind is FailureKind.PREFILL_FAILED
        assert channel.num_frames == 1 and channel.num_chunks == 2
        channel.abort("b")  # finished: nothing to abort
        channel.abort("a")
        await _wait(lambda: rec.aborts == ["a"])
        # The decode replica goes away: the open request fails, retryably, at once.
        qd = await channel.submit(Submit("d", [1], SamplingParams()))
        await _wait(lambda: len(rec.submits) == 4)
        await server.close()
        assert isinstance(await asyncio.wait_for(qd.get(), 5), ChannelClosed)
        # ... and the server told the worker which requests that connection still had.
        assert rec.closed == [{"d"}]

        # The ingress goes away: decode learns every request that was open on its connection.
        server2 = rec.server()
        address2 = await server2.start("127.0.0.1")
        channel2 = RequestChannelClient("decode-0", address2, "ingress-b")
        for rid in ("x", "y"):
            await channel2.submit(Submit(rid, [1], SamplingParams()))
        await _wait(lambda: len(rec.submits) == 6)
        await channel2.close()
        await _wait(lambda: len(rec.closed) == 2)
        assert rec.closed[1] == {"x", "y"}
        await server2.close()

    asyncio.run(go())


def test_handshake_refuses_the_wrong_replica_or_version():
    async def go():
        rec = Recorder()
        server = rec.server("decode-7")
        address = await server.start("127.0.0.1")
        # A port that now belongs to another replica (the old one died and the port was reused).
        with pytest.raises(ChannelClosed, match="is decode-7, not decode-3"):
            await RequestChannelClient("decode-3", address, "ing").submit(Submit("a", [1], SamplingParams()))
        # A peer of another protocol version is refused before any request.
        reader, writer = await asyncio.open_connection(*address)
        writer.write(encode_frame(Hello(CHANNEL_VERSION + 1, "old-ingress")))
        welcome = decode_to_ingress(await read_frame(reader))
        assert isinstance(welcome, Welcome) and f"version {CHANNEL_VERSION + 1}" in welcome.error
        assert await read_frame(reader) is None  # then closed
        writer.close()
        # Garbage instead of a Hello: refused, nothing reaches the worker.
        reader, writer = await asyncio.open_connection(*address)
        writer.write(struct.pack("!I", 3) + b"abc")
        assert decode_to_ingress(await read_frame(reader)).error
        writer.close()
        assert rec.submits == []
        await server.close()

    asyncio.run(go())


def test_event_log_answers_each_follower_from_its_position():
    worker = EngineWorker.__new__(EngineWorker)  # only the log: no engine needed
    worker.events = deque(maxlen=4)
    worker.events.extend(KVEvent(seq, STORED, (seq,)) for seq in range(1, 7))  # 1 and 2 fell out
    assert [e.seq for e in worker.events_after(4)] == [5, 6]
    assert worker.events_after(6) == [] and worker.events_after(None) == []  # None: the controller's poll
    # A follower behind the log gets what is left; the first seq is not last + 1, so its router
    # sees the gap and resyncs from snapshot().
    assert [e.seq for e in worker.events_after(1)] == [3, 4, 5, 6]
