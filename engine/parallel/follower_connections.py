"""How a served replica's driver takes its followers' connections: its gang's rank actors are
not its children (no pipe is handed to them), so each one dials a listener of the driver's,
authenticates with a fresh key and says its rank; that connection is then its pipe
(tp_ranks.py's FollowerLauncher starts them, runtime/tp_rank_actor.py dials)."""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from multiprocessing.connection import Connection, Listener
from typing import TYPE_CHECKING

from splitserve.engine.parallel.tp_group import TensorParallelError

if TYPE_CHECKING:
    from splitserve.engine.parallel.tp_ranks import FollowerLauncher, FollowerStart


def accept_followers(
    launch: FollowerLauncher, start: FollowerStart, deadline: float, timeout_s: float
) -> list[Connection]:
    """Have launch start ranks 1..size-1 (start: all but the listener's address and key) and
    take each one's connection, in rank order; a rank that does not dial in by the deadline is
    a start-up error naming the ranks missing."""
    size = start.size
    authkey = secrets.token_bytes(16)
    listener = Listener((start.host, 0), authkey=authkey)
    conns: dict[int, Connection] = {}

    def accept() -> None:
        try:
            while len(conns) < size - 1:
                conn = listener.accept()
                if conn.poll(max(deadline - time.monotonic(), 0.0)):
                    conns[int(conn.recv())] = conn
        except (OSError, EOFError):
            pass  # the listener closed at the deadline, or a rank hung up: reported as missing

    acceptor = threading.Thread(target=accept, name="tp-accept", daemon=True)
    try:
        acceptor.start()
        launch(dataclasses.replace(start, address=listener.address, authkey=authkey))
        acceptor.join(max(deadline - time.monotonic(), 0.0))
    finally:
        listener.close()  # ends a pending accept()
    missing = [rank for rank in range(1, size) if rank not in conns]
    if missing:
        for conn in conns.values():
            conn.close()
        raise TensorParallelError(f"tensor-parallel ranks {missing} did not connect within {timeout_s:.0f}s")
    return [conns[rank] for rank in range(1, size)]
