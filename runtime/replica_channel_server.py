"""ReplicaChannelServer: a replica's end of the request channel (proto/messages/request_channel.py).

An asyncio TCP server on the actor's event loop, in every replica of both pools. Each ingress
connects once and sends a Hello; every later frame is a Submit or an Abort (decode replicas
only: a prefill replica's server has no on_submit and refuses them) or a Subscribe /
Unsubscribe, handed to the worker's callbacks in the order it arrived. When a connection
ends -- the ingress closed it, died, or sent garbage -- the worker's on_close aborts every
request that came on it, and it stops getting pushed state.

It lives in runtime/ because both workers run one (prefill/ and decode/ never import each
other); it knows nothing of the engine.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from splitserve.proto.messages.request_channel import (
    CHANNEL_VERSION,
    Abort,
    ChannelError,
    Hello,
    Submit,
    Subscribe,
    Unsubscribe,
    Welcome,
    check_version,
    decode_to_decode,
    encode_frame,
    read_frame,
)

logger = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0
# An ingress that stops reading (hung, not dead) must not grow this replica's memory without
# bound: past this much unsent output its connection is closed and its requests aborted.
MAX_UNSENT_BYTES = 64 << 20
# Pushed state is skipped (not queued) for an ingress with this much unsent: it sees the frame
# numbers jump once it reads again, and resyncs from one snapshot.
MAX_STATE_BACKLOG_BYTES = 1 << 20


class IngressConnection:
    """One ingress's connection: where its requests' frames go, and which requests it sent."""

    def __init__(self, ingress_id: str, writer: asyncio.StreamWriter):
        self.ingress_id = ingress_id
        self.writer = writer
        self.request_ids: set[str] = set()
        self.closed = False
        self.subscribed = False  # it gets this replica's pushed state (ReplicaState frames)

    def send(self, data: bytes) -> None:
        """Queue bytes for the ingress (one write per engine step); dropped once closed."""
        if self.closed:
            return
        self.writer.write(data)
        if self.writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            logger.warning("ingress %s stopped reading its tokens; closing its connection", self.ingress_id)
            self.writer.transport.abort()  # the reader sees the close and aborts its requests
            self.closed = True

    def send_state(self, frame: bytes) -> bool:
        """Queue one pushed state frame unless the ingress is that far behind; False: skipped."""
        if self.closed or self.writer.transport.get_write_buffer_size() > MAX_STATE_BACKLOG_BYTES:
            return False
        self.writer.write(frame)
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


class ReplicaChannelServer:
    def __init__(
        self,
        replica_id: str,
        on_submit: Callable[[IngressConnection, Submit], None] | None,
        on_abort: Callable[[IngressConnection, str], None] | None,
        on_close: Callable[[IngressConnection], None] | None,
        on_subscribe: Callable[[IngressConnection, Subscribe], None] | None = None,
    ):
        """on_submit / on_abort None: this replica takes no requests (a prefill replica).
        on_subscribe(conn, Subscribe): push state to conn (the worker's StatePublisher)."""
        self.replica_id = replica_id
        self.on_submit, self.on_abort, self.on_close = on_submit, on_abort, on_close
        self.on_subscribe = on_subscribe
        self.connections: set[IngressConnection] = set()
        self._server: asyncio.Server | None = None
        self.address: tuple[str, int] | None = None

    async def start(self, host: str) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, 0, reuse_address=True)
        sock = self._server.sockets[0]
        self.address = (host, sock.getsockname()[1])
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = writer.get_extra_info("peername")
        try:
            hello = await asyncio.wait_for(self._handshake(reader), HANDSHAKE_TIMEOUT_S)
        except (ChannelError, TimeoutError, ConnectionError) as exc:
            logger.warning("%s: refused a request-channel connection from %s: %s", self.replica_id, peer, exc)
            writer.write(encode_frame(Welcome(CHANNEL_VERSION, self.replica_id, error=str(exc))))
            writer.close()
            return
        conn = IngressConnection(hello.ingress_id, writer)
        self.connections.add(conn)
        writer.write(encode_frame(Welcome(CHANNEL_VERSION, self.replica_id)))
        try:
            while (body := await read_frame(reader)) is not None:
                message = decode_to_decode(body)
                if isinstance(message, Submit) and self.on_submit is not None:
                    self.on_submit(conn, message)
                elif isinstance(message, Abort) and self.on_abort is not None:
                    self.on_abort(conn, message.request_id)
                elif isinstance(message, Subscribe) and self.on_subscribe is not None:
                    conn.subscribed = True
                    self.on_subscribe(conn, message)
                elif isinstance(message, Unsubscribe):
                    conn.subscribed = False
                else:
                    raise ChannelError(f"unexpected {type(message).__name__} after the handshake")
        except (ChannelError, ConnectionError) as exc:
            logger.warning("%s: request channel from %s failed: %s", self.replica_id, conn.ingress_id, exc)
        except asyncio.CancelledError:
            pass  # the server is shutting down
        finally:
            self.connections.discard(conn)
            conn.close()
            if self.on_close is not None:
                self.on_close(conn)

    @staticmethod
    async def _handshake(reader: asyncio.StreamReader) -> Hello:
        body = await read_frame(reader)
        if body is None:
            raise ConnectionError("closed before its Hello")
        hello = decode_to_decode(body)
        if not isinstance(hello, Hello):
            raise ChannelError(f"expected Hello first, got {type(hello).__name__}")
        check_version(hello.version, f"ingress {hello.ingress_id}")
        return hello
