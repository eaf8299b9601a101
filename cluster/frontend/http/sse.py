"""A server-sent-events response that stops generation the moment its client goes away.

Starlette's StreamingResponse only notices a disconnect on some ASGI versions, and even then
leaves a body generator that was parked at a `yield` for the garbage collector. Here the
client is watched for the whole response, and both the event iterator and the backend's
generator are closed explicitly, so the request is aborted on its replica right away.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The ASGI scope key under which the app's outermost middleware (AccessLog) leaves the `send`
# it was given. An event stream's body messages go straight to it: every layer between (that
# middleware's own, Starlette's error and exception middleware, the route's) looks only at
# http.response.start, and each was a coroutine call per token on the relay's hot path.
BODY_SEND = "splitserve.body_send"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client disconnects (call after the request body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(receive: Receive, work):
    """Await `work` (an awaitable); cancel it and raise ClientDisconnected if the client leaves."""
    outcome: tuple[bool, object] | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await wait_for_disconnect(receive)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            outcome = (True, await work)
        except Exception as exc:  # re-raised below, so it is not wrapped in an ExceptionGroup
            outcome = (False, exc)
        finally:
            group.cancel_scope.cancel()
    if outcome is None:
        raise ClientDisconnected()
    ok, value = outcome
    if not ok:
        raise value
    return value


class LastEvent(str):
    """The last text of an event stream: SSEResponse sends it as the body's final part (one
    write with the chunked body's end) and reads nothing after it."""


class SSEResponse(StreamingResponse):
    """text/event-stream of `events` (str; a LastEvent ends the body); `source` (the backend
    generator feeding them) is closed when the response ends for any reason: finished,
    client disconnect, or error."""

    def __init__(
        self,
        events: AsyncIterator[str],
        source: AsyncGenerator | None = None,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        """on_close: called once the response is over and its sources are closed."""
        headers = {**SSE_HEADERS, **(headers or {})}
        super().__init__(events, status_code=status_code, headers=headers, media_type="text/event-stream")
        self.source = source
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_events(send, scope.get(BODY_SEND, send))
                    except OSError:  # ASGI 2.4 servers raise on send after a disconnect
                        logger.debug("client disconnected while streaming")
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.close_sources()

    async def stream_events(self, send: Send, body_send: Send) -> None:
        """StreamingResponse.stream_response, but the body goes to body_send (BODY_SEND), and
        the LastEvent carries the body's end (more_body False) instead of an empty message
        after it: one socket write less per stream."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.body_iterator:
            last = type(event) is LastEvent
            await body_send({"type": "http.response.body", "body": event.encode(), "more_body": not last})
            if last:
                return
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})

    async def close_sources(self) -> None:
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()
        if self.source is not None:
            await self.source.aclose()
        if self.on_close is not None:
            self.on_close()
