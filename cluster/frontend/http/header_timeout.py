"""A request-header timeout for uvicorn, which has none: a connection whose request headers
are not complete within the timeout after it opens (or after its first byte of a later
request) is closed. Without it a client that sends half a request line, or connects and
sends nothing, holds the connection until it gives up. The body has its own bound in
RequestGuard (guard.py), with the same timeout; a response, however long it streams, is
never timed: the timer only runs while a request's headers are arriving.

Ray Serve builds each ingress replica's uvicorn itself (uvicorn's `http="auto"`), so
install() points uvicorn's "auto" protocol at this class in that process, before Serve
starts the server (SplitServeIngress's constructor runs first). Servers splitserve builds
itself pass the class as `http=`.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.auto import AutoHTTPProtocol


class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    header_timeout_s: float = 30.0  # set by install() / with_timeout()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._armed_cycle = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._between_requests():
            self._arm()  # the first bytes of a later request on a kept-alive connection
        super().data_received(data)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._armed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        # A request whose headers completed since arming has a new cycle: not ours to time.
        if self.cycle is self._armed_cycle and self._between_requests() and not self.transport.is_closing():
            self.transport.close()


def with_timeout(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """A protocol class with its own timeout (one per server; tests run several)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": float(timeout_s)})


def install(timeout_s: float) -> None:
    """Make uvicorn's default ("auto") protocol in this process time request headers out."""
    import uvicorn.config

    global _INSTALLED
    _INSTALLED = with_timeout(timeout_s)
    uvicorn.config.HTTP_PROTOCOLS["auto"] = f"{__name__}:_INSTALLED"


_INSTALLED: type[HeaderTimeoutProtocol] = HeaderTimeoutProtocol
