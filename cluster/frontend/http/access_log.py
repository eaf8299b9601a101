"""AccessLog: one log line per HTTP request, "GET /v1/models 200 1.2ms", and the response
headers that say which ingress replica answered (x-splitserve-ingress) and echo the client's
own request id (x-request-id, also logged: "... 200 1.2ms id=abc").

It replaces Ray Serve's access log, which names the matched route ("/" for every unknown
path) and logs Prometheus scrapes and health probes at INFO. Here the path is the one the
client asked for, and /metrics and /health log at DEBUG (set SPLITSERVE_LOG_LEVEL=DEBUG to
see them). Logger: splitserve.access.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.cluster.frontend.first_token_stages import RECEIVED_AT
from splitserve.cluster.frontend.http.sse import BODY_SEND

logger = logging.getLogger("splitserve.access")
QUIET_PATHS = frozenset({"/metrics", "/health"})  # scraped every few seconds
INGRESS_HEADER = "x-splitserve-ingress"
REQUEST_ID_HEADER = "x-request-id"
MAX_LABEL_CHARS = 128


def client_request_id(headers) -> str | None:
    """The client's x-request-id from ASGI headers (a label: never a key), printable and capped."""
    for key, value in headers:
        if key == REQUEST_ID_HEADER.encode():
            label = value.decode("latin-1")[:MAX_LABEL_CHARS]
            return label if label.isprintable() and label else None
    return None


LOG_LEVEL_ENV = "SPLITSERVE_LOG_LEVEL"
_LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s -- %(message)s"


class AccessLog:
    """ASGI middleware; put it outermost so refusals by inner middleware are logged too."""

    def __init__(self, app: ASGIApp, ingress_id: str | None = None, echo_request_id: bool = True):
        """echo_request_id: False where the server in front (Ray Serve) echoes it already."""
        self.app = app
        self.ingress_id = ingress_id
        self.echo_request_id = echo_request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = scope[RECEIVED_AT] = time.perf_counter()  # the first token's ingress stage starts
        scope[BODY_SEND] = send  # an event stream's body skips the layers inside (sse.py)
        status = 499  # nginx's "client closed request": no response was started
        label = client_request_id(scope.get("headers", ()))
        extra = []
        if self.ingress_id:
            extra.append((INGRESS_HEADER.encode(), self.ingress_id.encode()))
        if label is not None and self.echo_request_id:
            extra.append((REQUEST_ID_HEADER.encode(), label.encode("latin-1")))

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if extra:
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except BaseException:
            status = 500 if status == 499 else status
            raise
        finally:
            path = scope.get("path", "")
            level = logging.DEBUG if path in QUIET_PATHS else logging.WARNING if status >= 500 else logging.INFO
            logger.log(
                level,
                "%s %s %d %.1fms%s",
                scope.get("method", ""),
                path,
                status,
                1e3 * (time.perf_counter() - start),
                "" if label is None else f" id={label}",
            )


def configure_replica_logging() -> None:
    """Send splitserve's loggers to the process's stderr at SPLITSERVE_LOG_LEVEL (default
    INFO) in a Ray Serve replica, whose root logger shows warnings only; Ray forwards stderr
    to `splitserve serve`. sys.__stderr__: Serve may have pointed sys.stderr at its log files."""
    root = logging.getLogger("splitserve")
    if not root.handlers:
        handler = logging.StreamHandler(sys.__stderr__)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO").upper())
