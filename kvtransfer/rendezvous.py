"""Where the two ends of a pair meet: a TCPStore hosted by the sender, namespaced per pair.

The sender endpoint hosts one TCPStore server for all its pairs (started on first use, port 0
= any free port) and publishes its (host, port). Each pair opening, on either side, makes its
own client connection to that server and wraps it in a PrefixStore(pair_key): many pairs share
one server, and a pair re-created after a restart uses a fresh epoch, hence fresh keys.
A private connection per opening matters because a c10d store wait blocks the connection it
runs on, and concurrent openings must not queue behind each other.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from splitserve.kvtransfer.errors import TransferError, TransportUsageError

Address = tuple[str, int]


def pair_key(sender_id: str, receiver_id: str, epoch: int) -> str:
    """The store namespace of one incarnation of a (sender, receiver) pair."""
    if epoch < 0:
        raise TransportUsageError(f"epoch must be >= 0, got {epoch}")
    return f"{sender_id}->{receiver_id}/{epoch}"


class Rendezvous:
    """This endpoint's store server (if it sends) and client connections to peers' servers."""

    def __init__(self, host: str, timeout_s: float):
        if timeout_s <= 0:
            raise TransportUsageError(f"timeout_s must be > 0, got {timeout_s}")
        self.host = host
        self.timeout_s = timeout_s
        self._server: dist.TCPStore | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> Address:
        """(host, port) of this endpoint's store server; starts it on first use."""
        with self._lock:
            if self._server is None:
                try:
                    self._server = dist.TCPStore(
                        self.host,
                        0,
                        None,
                        True,
                        timedelta(seconds=self.timeout_s),
                        wait_for_workers=False,
                    )
                except (RuntimeError, OSError) as exc:
                    raise TransferError(f"cannot start a store server on {self.host}: {exc}") from exc
            return self.host, self._server.port

    def connect(self, address: Address, pair_key_: str, timeout_s: float) -> dist.PrefixStore:
        """A new client connection to the store at address, namespaced by pair_key_."""
        host, port = address
        # Probe first: a refused connection fails now, while TCPStore's own connect retries
        # with back-off and can overrun the timeout by seconds.
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        except OSError as exc:
            raise TransferError(f"no store is listening at {host}:{port}: {exc}") from exc
        try:
            client = dist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError / TimeoutError
            raise TransferError(f"cannot reach the store at {host}:{port} within {timeout_s:.1f}s: {exc}") from exc
        return dist.PrefixStore(pair_key_, client)

    def close(self) -> None:
        """Stop serving: peers that have not joined yet time out; open pairs are unaffected."""
        with self._lock:
            self._server = None
