"""RequestChannelServer: the decode replica's end of the request channel (proto/messages/request_channel.py).

An asyncio TCP server on the actor's event loop. Each ingress connects once and sends a
Hello; every later frame is a Submit or an Abort, handed to the worker's callbacks in the
order it arrived. When a connection ends -- the ingress closed it, died, or sent garbage --
the worker's on_close aborts every request that came on it.
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


class IngressConnection:
    """One ingress's connection: where its requests' frames go, and which requests it sent."""

    def __init__(self, ingress_id: str, writer: asyncio.StreamWriter):
        self.ingress_id = ingress_id
        self.writer = writer
        self.request_ids: set[str] = set()
        self.closed = False

    def send(self, data: bytes) -> None:
        """Queue bytes for the ingress (one write per engine step); dropped once closed."""
        if self.closed:
            return
        self.writer.write(data)
        if self.writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            logger.warning("ingress %s stopped reading its tokens; closing its connection", self.ingress_id)
            self.writer.transport.abort()  # the reader sees the close and aborts its requests
            self.closed = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


class RequestChannelServer:
    def __init__(
        self,
        replica_id: str,
        on_submit: Callable[[IngressConnection, Submit], None],
        on_abort: Callable[[IngressConnection, str], None],
        on_close: Callable[[IngressConnection], None],
    ):
        self.replica_id = replica_id
        self.on_submit, self.on_abort, self.on_close = on_submit, on_abort, on_close
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
                if isinstance(message, Submit):
                    self.on_submit(conn, message)
                elif isinstance(message, Abort):
                    self.on_abort(conn, message.request_id)
                else:
                    raise ChannelError(f"unexpected {type(message).__name__} after the handshake")
        except (ChannelError, ConnectionError) as exc:
            logger.warning("%s: request channel from %s failed: %s", self.replica_id, conn.ingress_id, exc)
        except asyncio.CancelledError:
            pass  # the server is shutting down
        finally:
            self.connections.discard(conn)
            conn.close()
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
