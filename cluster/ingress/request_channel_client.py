"""RequestChannelClient: an ingress's one connection to one replica's request channel
(proto/messages/request_channel.py), opened on first use and again after it broke.

submit() registers a request and sends its Submit (decode replicas); the reader task fans each
TokenBatch out to the requests' queues (StreamChunk items), and a Failed to its request.
abort() sends an Abort for a request still open. When the connection ends, every open
request's queue gets a ChannelClosed: the dispatcher retries it elsewhere if nothing streamed
yet. subscribe() asks the replica (either pool) to push its state: each ReplicaState frame
goes to on_state, and on_lost is called once when a subscribed connection ends without
close() (the replica died, or the channel broke).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.request_channel import (
    CHANNEL_VERSION,
    Abort,
    ChannelError,
    Failed,
    Hello,
    ReplicaState,
    Submit,
    Subscribe,
    TokenBatch,
    Unsubscribe,
    Welcome,
    check_version,
    decode_to_ingress,
    encode_frame,
    read_frame,
)

logger = logging.getLogger(__name__)
StreamItem = StreamChunk | Failed | ConnectionError


class ChannelClosed(ConnectionError):
    """The connection to the decode replica ended (it died, or the channel broke)."""


class RequestChannelClient:
    def __init__(self, replica_id: str, address: tuple[str, int], ingress_id: str, connect_timeout_s: float = 10.0):
        self.replica_id = replica_id
        self.address = (address[0], int(address[1]))
        self.ingress_id = ingress_id
        self.connect_timeout_s = connect_timeout_s
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._connecting = asyncio.Lock()
        self._closed = False
        self.num_connects = 0
        self.num_frames = 0  # TokenBatch frames received: one per engine step with output for us
        self.num_chunks = 0
        self.on_state: Callable[[ReplicaState], None] | None = None
        self.on_lost: Callable[[], None] | None = None
        self.subscribed = False
        self.num_states = 0  # ReplicaState frames received

    @property
    def num_open(self) -> int:
        return len(self._streams)

    async def submit(self, submit: Submit) -> asyncio.Queue[StreamItem]:
        """Send a request; its chunks (or its Failed / ChannelClosed) arrive on the queue."""
        writer = await self._connected()
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[submit.request_id] = queue
        writer.write(encode_frame(submit))
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request that has not finished (a no-op for one that has)."""
        if self._streams.pop(request_id, None) is not None and self._writer is not None:
            self._writer.write(encode_frame(Abort(request_id)))

    async def subscribe(
        self,
        since_seq: int,
        on_state: Callable[[ReplicaState], None],
        on_lost: Callable[[], None],
        events: bool = True,
        interval_s: float = 0.0,
    ) -> None:
        """Have the replica push its state (connecting if need be); ChannelClosed if
        unreachable. events False: load and health only, every interval_s (Subscribe)."""
        self.on_state, self.on_lost = on_state, on_lost
        writer = await self._connected()
        self.subscribed = True
        writer.write(encode_frame(Subscribe(since_seq, events, interval_s)))

    def unsubscribe(self) -> None:
        if self.subscribed and self._writer is not None:
            self._writer.write(encode_frame(Unsubscribe()))
        self.subscribed = False

    async def close(self) -> None:
        """Close for good: open requests fail with ChannelClosed; decode aborts them."""
        self._closed = True
        self.subscribed = False
        writer, task = self._writer, self._reader_task
        self._lost(ChannelClosed(f"the ingress dropped decode replica {self.replica_id}"))
        if writer is not None:
            writer.close()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _connected(self) -> asyncio.StreamWriter:
        if self._writer is not None:
            return self._writer
        async with self._connecting:
            if self._closed:
                raise ChannelClosed(f"decode replica {self.replica_id} was dropped")
            if self._writer is None:
                try:
                    reader, writer = await asyncio.wait_for(self._open(), self.connect_timeout_s)
                except (OSError, TimeoutError, ChannelError) as exc:
                    raise ChannelClosed(f"cannot reach decode replica {self.replica_id}: {exc}") from None
                self._writer = writer
                self._reader_task = asyncio.get_running_loop().create_task(self._read(reader, writer))
                self.num_connects += 1
        return self._writer

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(*self.address)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            writer.write(encode_frame(Hello(CHANNEL_VERSION, self.ingress_id)))
            body = await read_frame(reader)
            welcome = None if body is None else decode_to_ingress(body)
            if not isinstance(welcome, Welcome):
                raise ChannelError(f"expected Welcome, got {type(welcome).__name__}")
            if welcome.error:
                raise ChannelError(welcome.error)
            check_version(welcome.version, f"decode replica {welcome.replica_id}")
            if welcome.replica_id != self.replica_id:  # the port now belongs to someone else
                raise ChannelError(f"{self.address} is {welcome.replica_id}, not {self.replica_id}")
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        streams = self._streams
        reason = "closed by the replica"
        try:
            while (body := await read_frame(reader)) is not None:
                message = decode_to_ingress(body)
                if isinstance(message, ReplicaState):
                    self.num_states += 1
                    if self.subscribed and self.on_state is not None:
                        self.on_state(message)
                elif isinstance(message, TokenBatch):
                    self.num_frames += 1
                    self.num_chunks += len(message.chunks)
                    for chunk in message.chunks:
                        queue = streams.get(chunk.request_id)
                        if queue is not None:  # else: aborted here, its Abort is on the way
                            queue.put_nowait(chunk)
                            if chunk.finished:
                                del streams[chunk.request_id]
                elif isinstance(message, Failed):
                    queue = streams.pop(message.request_id, None)
                    if queue is not None:
                        queue.put_nowait(message)
                else:
                    raise ChannelError(f"unexpected {type(message).__name__} after the handshake")
        except asyncio.CancelledError:
            return
        except (ChannelError, OSError) as exc:
            reason = str(exc)
            logger.warning("request channel to %s failed: %s", self.replica_id, exc)
        finally:
            writer.close()
        if self._writer is writer:
            self._lost(ChannelClosed(f"decode replica {self.replica_id} went away ({reason})"))
            if self.subscribed and not self._closed:
                self.subscribed = False
                if self.on_lost is not None:
                    self.on_lost()

    def _lost(self, error: ChannelClosed) -> None:
        self._writer, self._reader_task = None, None
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(error)
