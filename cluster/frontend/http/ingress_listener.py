"""IngressListener: the ingress replica's own uvicorn on the configured HTTP address, for
`http_listener: ingress` (a single ingress replica; cluster/cli/serve.py decides).

Why: behind Ray's HAProxy every SSE event is a recv and a send more in HAProxy, and Serve keeps
a Python proxy actor beside it (the fallback proxy) that costs CPU even idle; per event the
replica's own listener also wraps `send` twice more (Serve's direct-ingress path). With one
ingress replica there is nothing to balance, so the replica answers on the configured port
itself, Serve runs with no proxy at all (proxy_location Disabled), and a token's relay is this
process alone (bench/results/vs_vllm_bench.md, *The relay's own listener*).

The socket is bound in the replica's constructor (bind()), so a taken port fails the start
with a StartupError naming it; requests are served only from the ASGI lifespan's start
(serve()), after the app's own start-up, and stop() closes the listener before the backends
shut down, letting streams in flight finish within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

logger = logging.getLogger(__name__)
# Connections the kernel queues while the app is busy accepting (uvicorn's default is 2048).
LISTEN_BACKLOG = 2048


class IngressListener:
    def __init__(self, host: str, port: int, keep_alive_timeout_s: int, backlog: int = LISTEN_BACKLOG):
        self.host, self.port, self.keep_alive_timeout_s, self.backlog = host, port, keep_alive_timeout_s, backlog
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    def bind(self) -> None:
        """Take the address now; OSError (e.g. the port in use) for the constructor to report."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted replica rebinds at once
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]  # port 0: the one the kernel chose
        self._sock = sock

    async def serve(self, app) -> None:
        """Start answering on the bound socket; returns once the listener accepts connections."""
        if self._sock is None:
            raise RuntimeError("IngressListener.serve() before bind()")
        config = uvicorn.Config(
            app,
            timeout_keep_alive=self.keep_alive_timeout_s,
            backlog=self.backlog,
            lifespan="off",  # Serve runs the app's lifespan; this listener is started from it
            access_log=False,  # the app logs each request itself (access_log.py)
            log_config=None,
            # http="auto": the header-timeout protocol the replica installed (header_timeout.py)
        )
        server = uvicorn.Server(config)
        # The replica's signals are Ray's: uvicorn must neither take nor re-raise them.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self._server = server
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[self._sock]))
        while not server.started:
            if self._task.done():  # it failed before listening: raise its error here
                self._task.result()
                raise RuntimeError(f"the HTTP listener on {self.host}:{self.port} stopped before it started")
            await asyncio.sleep(0.01)
        logger.info("ingress HTTP listener on %s:%d", self.host, self.port)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, give open requests (streams included) grace_s to finish, then close."""
        server, task = self._server, self._task
        self._server = self._task = None
        if server is not None and task is not None:
            server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(task), grace_s)
            except TimeoutError:
                server.force_exit = True  # uvicorn then cancels what is still running
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, 5.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
