"""SimulatedTransport: a simulated engine's KV transport -- the pair bookkeeping of
KVTransport (open, close, close idle) without process groups, since no tensor moves: the
transfer itself is SimulatedKVSender's timed wait, and the decode side receives nothing
(SimulatedReceive). The handoff protocol around it -- reserve, prefill, ack, cancel, lease --
is the real one."""

from __future__ import annotations

import threading
import time

from splitserve.kvtransfer.errors import TransportUsageError

ROLES = ("sender", "receiver")


class SimulatedTransport:
    def __init__(self, replica_id: str, host: str = "127.0.0.1"):
        self.replica_id = replica_id
        self.address = (host, 0)  # nothing listens: no rendezvous store is needed
        self._lock = threading.Lock()
        self._pairs: dict[str, tuple[int, float]] = {}  # peer id -> (epoch, opened at)

    def open_pair(self, peer_id: str, address=None, role: str = "sender", epoch: int = 0) -> None:
        if role not in ROLES:
            raise TransportUsageError(f"role must be one of {ROLES}, got {role!r}")
        with self._lock:
            self._pairs[peer_id] = (epoch, time.monotonic())

    def has_pair(self, peer_id: str) -> bool:
        return peer_id in self._pairs

    def close_pair(self, peer_id: str, max_epoch: int | None = None) -> bool:
        with self._lock:
            pair = self._pairs.get(peer_id)
            if pair is None or (max_epoch is not None and pair[0] > max_epoch):
                return False
            del self._pairs[peer_id]
            return True

    def close_idle(self, max_idle_s: float) -> list[str]:
        """Pairs opened more than max_idle_s ago (the simulated pair has no traffic clock)."""
        now = time.monotonic()
        with self._lock:
            idle = [peer for peer, (_, opened) in self._pairs.items() if now - opened >= max_idle_s]
            for peer in idle:
                del self._pairs[peer]
        return idle

    def close(self) -> None:
        with self._lock:
            self._pairs.clear()
