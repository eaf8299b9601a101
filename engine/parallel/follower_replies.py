"""ReplyListener: the driver's thread that reads what its follower ranks' extensions send back
(follower_extension.py's FollowerContext.reply) and hands each reply to one handler, in the
order each rank sent them. A rank whose connection ends (it exited, or was killed) is reported
once as handler(rank, None), so whoever waits on it fails at once instead of at a timeout."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

REPLY = "reply"  # (REPLY, payload): a follower's message to the driver after start-up
_POLL_S = 0.5  # how often the thread looks whether it was stopped


class ReplyListener:
    def __init__(self, conns: list[Connection], handler: Callable[[int, Any], None]):
        """conns: ranks 1..N-1's connections, in rank order."""
        self._ranks = {id(conn): (rank, conn) for rank, conn in enumerate(conns, start=1)}
        self._conns = list(conns)
        self._handler = handler
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-replies", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._conns and not self._stopped.is_set():
            try:
                ready = wait(self._conns, timeout=_POLL_S)
            except (OSError, ValueError):  # a connection closed under us: the ranks stop
                return
            for ready_conn in ready:
                rank, conn = self._ranks[id(ready_conn)]
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError, ValueError):
                    self._conns.remove(conn)
                    payload = None
                else:
                    if kind != REPLY:
                        logger.warning("tensor-parallel rank %d sent %r after start-up", rank, kind)
                        continue
                if self._stopped.is_set():
                    return
                try:
                    self._handler(rank, payload)
                except Exception:  # one bad reply must not end the thread every reply goes through
                    logger.exception("handling a reply of tensor-parallel rank %d failed", rank)

    def stop(self) -> None:
        self._stopped.set()
