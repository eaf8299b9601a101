"""AccessLog: one log line per HTTP request, "GET /v1/models 200 1.2ms".

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

logger = logging.getLogger("splitserve.access")
QUIET_PATHS = frozenset({"/metrics", "/health"})  # scraped every few seconds
LOG_LEVEL_ENV = "SPLITSERVE_LOG_LEVEL"
_LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s -- %(message)s"


class AccessLog:
    """ASGI middleware; put it outermost so refusals by inner middleware are logged too."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 499  # nginx's "client closed request": no response was started

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
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
                level, "%s %s %d %.1fms", scope.get("method", ""), path, status, 1e3 * (time.perf_counter() - start)
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
