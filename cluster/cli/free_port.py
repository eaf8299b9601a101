"""free_port: a port for a server started later (HAProxy's stats, metrics and fallback-proxy
ports that `splitserve serve` hands Ray; in tests also `splitserve serve` itself and Postgres).

A port the kernel hands out for port 0 comes from its ephemeral range, where every outgoing
connection also takes its local port, and so do Ray's own port-0 binds: Ray's processes open
connections all the time while a cluster starts, and one of them could take the port in the
seconds before the server binds it (seen in CI: Serve's fallback proxy failed to bind its
port). So the port comes from below that range and above Ray's worker ports (10002-19999): the
kernel never assigns one there, and a port another process holds is skipped (the bind check).
Random, so two servers (or test workers) asking at once do not pick the same one.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 20000  # Ray's default max_worker_port is 19999
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the kernel's ephemeral range where it can."""
    end = _ephemeral_start()
    if end - RAY_WORKER_PORTS_END >= 1000:
        for port in random.sample(range(RAY_WORKER_PORTS_END, end), 200):
            if _bindable(port):
                return port
    with socket.socket() as sock:  # a machine whose ephemeral range leaves no room below it
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
