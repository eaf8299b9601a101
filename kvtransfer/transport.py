"""KVTransport: one per replica; its pairs with each peer, opened lazily, with timeouts.

    prefill = KVTransport("prefill-0", kv_cache.device)            # sender side
    decode = KVTransport("decode-3", kv_cache.device)              # receiver side
    # both, concurrently (e.g. each told the other's id, the epoch and the sender's address):
    prefill.open_pair("decode-3", None, "sender", epoch)
    decode.open_pair("prefill-0", prefill.address, "receiver", epoch)
    op = decode.irecv("prefill-0", [staging], tag=7)               # post early ...
    prefill.send("decode-3", [packed], tag=7)                      # blocks until received
    op.wait(timeout_s)                                             # ... complete later

Channel, agreed per pair when it opens (kv_channel.py): NCCL between two GPUs, gloo for CPU, and
for two ends on one GPU (NCCL refuses that) CUDA IPC, or host memory if IPC fails
(`same_device`); the Pair that open_pair returns names it in `channel`. A failed or timed-out op
closes its pair (and fails the other ops pending on it) and raises TransferError; reopen with a
new epoch.
Thread-safe: ops on one pair are posted in call order, different tags and pairs overlap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from splitserve.kvtransfer.errors import TransferError, TransportUsageError
from splitserve.kvtransfer.host_address import resolve_host
from splitserve.kvtransfer.kv_channel import SAME_DEVICE_MODES
from splitserve.kvtransfer.pair import MAX_USER_TAG, ROLES, Pair
from splitserve.kvtransfer.rendezvous import Address, Rendezvous, pair_key
from splitserve.kvtransfer.transfer_op import TransferOp
from splitserve.kvtransfer.transfer_stats import TransferStats

__all__ = ["KVTransport", "resolve_host"]

# Per-call timeouts go up to _OP_TIMEOUT_FACTOR * timeout_s. NCCL's watchdog acts on ops older
# than its process group's timeout, so that is set _WATCHDOG_MARGIN_S later: a timed-out wait() aborts
# the pair first.
_OP_TIMEOUT_FACTOR = 3.0
_WATCHDOG_MARGIN_S = 30.0
_RESERVED_ID_CHARS = ("->", "/")


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_endpoint_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not value or any(c in value for c in _RESERVED_ID_CHARS):
        raise TransportUsageError(f"{name} must be a non-empty string without '->' or '/', got {value!r}")


class KVTransport:
    def __init__(
        self,
        endpoint_id: str,
        device: torch.device | str,
        host: str = "127.0.0.1",
        timeout_s: float = 20.0,
        same_device: str = "auto",
    ):
        """same_device: "auto" | "ipc" | "host", how pairs whose two ends share one device move
        tensors (see splitserve.kvtransfer.kv_channel); the sender's setting decides for a pair."""
        _check_endpoint_id("endpoint_id", endpoint_id)
        if timeout_s <= 0:
            raise TransportUsageError(f"timeout_s must be > 0, got {timeout_s}")
        if same_device not in SAME_DEVICE_MODES:
            raise TransportUsageError(f"same_device must be one of {SAME_DEVICE_MODES}, got {same_device!r}")
        self.endpoint_id = endpoint_id
        self.device = _normalize_device(device)
        self.same_device = same_device
        self.host = host
        self.timeout_s = timeout_s
        self._rendezvous = Rendezvous(host, timeout_s)
        self._pairs: dict[str, Pair] = {}
        self._open_locks: dict[str, threading.Lock] = {}
        self._totals = TransferStats()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def max_timeout_s(self) -> float:
        """The longest per-call timeout accepted."""
        return _OP_TIMEOUT_FACTOR * self.timeout_s

    @property
    def address(self) -> Address:
        """(host, port) of this endpoint's rendezvous store; receivers pass it to open_pair."""
        self._check_not_closed()
        return self._rendezvous.address

    def open_pair(
        self, peer_id: str, peer_address: Address | None, role: str, epoch: int, timeout_s: float | None = None
    ) -> Pair:
        """Open (or reuse) the pair with peer_id; blocks until the peer joins too.

        role "sender": this endpoint hosts the store (peer_address is ignored and may be None);
        role "receiver": peer_address is the sender's `address`. An open pair with the same
        role and epoch is returned as is; anything else replaces it.
        """
        self._check_not_closed()
        _check_endpoint_id("peer_id", peer_id)
        if role not in ROLES:
            raise TransportUsageError(f"role must be one of {ROLES}, got {role!r}")
        timeout_s = self._call_timeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        if role == "sender":
            key, address = pair_key(self.endpoint_id, peer_id, epoch), self.address
        else:
            if peer_address is None:
                raise TransportUsageError("a receiver needs the sender's address")
            key, address = pair_key(peer_id, self.endpoint_id, epoch), tuple(peer_address)
        open_lock = self._open_lock(peer_id)
        if not open_lock.acquire(timeout=timeout_s):
            raise TransferError(f"pair {key}: another open_pair with {peer_id!r} is still running")
        try:
            existing = self._live_pair(peer_id)
            if existing is not None and (existing.role, existing.epoch) == (role, epoch):
                return existing
            self.close_pair(peer_id)
            store = self._rendezvous.connect(address, key, max(deadline - time.monotonic(), 0.001))
            pair = Pair.open(
                peer_id,
                role,
                epoch,
                key,
                self.device,
                store,
                self.host,
                timeout_s=max(deadline - time.monotonic(), 0.001),
                op_timeout_s=self.max_timeout_s + _WATCHDOG_MARGIN_S,
                default_timeout_s=self.timeout_s,
                on_stats=self._add_stats,
                same_device=self.same_device,
            )
            with self._lock:
                closed = self._closed
                if not closed:
                    self._pairs[peer_id] = pair
            if closed:
                pair.close()
                raise TransferError(f"pair {key}: the transport was closed while opening")
            return pair
        finally:
            open_lock.release()

    def isend(self, peer_id: str, tensors: Sequence[torch.Tensor], tag: int) -> TransferOp:
        """Post sends of tensors, in order; the receiver posts same-shaped buffers, same tag."""
        return self._post(peer_id, tensors, tag, sending=True)

    def irecv(self, peer_id: str, tensors: Sequence[torch.Tensor], tag: int) -> TransferOp:
        """Post receives into preallocated tensors; they hold data once wait() returns."""
        return self._post(peer_id, tensors, tag, sending=False)

    def send(self, peer_id: str, tensors: Sequence[torch.Tensor], tag: int, timeout_s: float | None = None) -> int:
        """Send and wait until the peer has received; returns bytes sent."""
        timeout_s = self._call_timeout(timeout_s)  # checked before anything is posted
        return self.isend(peer_id, tensors, tag).wait(timeout_s)

    def recv(self, peer_id: str, tensors: Sequence[torch.Tensor], tag: int, timeout_s: float | None = None) -> int:
        """Receive into preallocated tensors, in order; returns bytes received."""
        timeout_s = self._call_timeout(timeout_s)
        return self.irecv(peer_id, tensors, tag).wait(timeout_s)

    def has_pair(self, peer_id: str) -> bool:
        return self._live_pair(peer_id) is not None

    def peers(self) -> list[str]:
        with self._lock:
            candidates = list(self._pairs)
        return sorted(peer for peer in candidates if self._live_pair(peer) is not None)

    def close_pair(self, peer_id: str, max_epoch: int | None = None) -> bool:
        """Tear down the pair with peer_id; its pending ops fail. False if none was open.
        max_epoch: only a pair of that epoch or older (a newer one was opened meanwhile)."""
        with self._lock:
            pair = self._pairs.get(peer_id)
            if pair is None or (max_epoch is not None and pair.epoch > max_epoch):
                return False
            del self._pairs[peer_id]
        was_open = pair.is_open
        pair.close()
        return was_open

    def close_idle(self, max_idle_s: float) -> list[str]:
        """Tear down pairs unused for max_idle_s with no op pending; returns their peer ids."""
        with self._lock:
            candidates = list(self._pairs.items())
        closed = []
        for peer_id, pair in candidates:
            if pair.close_if_idle(max_idle_s):
                closed.append(peer_id)
            self._live_pair(peer_id)  # drops it from the table if closed
        return sorted(closed)

    def stats(self) -> TransferStats:
        """Totals over every pair this transport opened, closed ones included."""
        with self._lock:
            return self._totals.copy()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = list(self._pairs)
        for peer_id in peers:
            self.close_pair(peer_id)
        self._rendezvous.close()

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _post(self, peer_id: str, tensors: Sequence[torch.Tensor], tag: int, sending: bool) -> TransferOp:
        self._check_not_closed()
        self._check_tensors(tensors)
        if not isinstance(tag, int) or not 0 <= tag <= MAX_USER_TAG:
            raise TransportUsageError(f"tag must be an int in [0, {MAX_USER_TAG}], got {tag!r}")
        pair = self._live_pair(peer_id)
        if pair is None:
            raise TransferError(f"no open pair between {self.endpoint_id!r} and {peer_id!r}; call open_pair")
        return pair.post(list(tensors), tag, sending)

    def _live_pair(self, peer_id: str) -> Pair | None:
        """The open pair with peer_id; a pair that closed itself (after a failure) is dropped."""
        with self._lock:
            pair = self._pairs.get(peer_id)
            if pair is not None and not pair.is_open:
                del self._pairs[peer_id]
                pair = None
        return pair

    def _check_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        if isinstance(tensors, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TransportUsageError("tensors must be a list of torch.Tensor")
        for t in tensors:
            if t.device != self.device:
                raise TransportUsageError(f"tensor on {t.device}, but this transport moves {self.device} tensors")
            if not t.is_contiguous():
                raise TransportUsageError(f"tensor of shape {tuple(t.shape)} is not contiguous")

    def _call_timeout(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self.timeout_s
        if not 0 < timeout_s <= self.max_timeout_s:
            raise TransportUsageError(f"timeout_s must be in (0, {self.max_timeout_s}], got {timeout_s}")
        return timeout_s

    def _open_lock(self, peer_id: str) -> threading.Lock:
        with self._lock:
            return self._open_locks.setdefault(peer_id, threading.Lock())

    def _add_stats(self, delta: TransferStats) -> None:
        with self._lock:
            self._totals.add(delta)

    def _check_not_closed(self) -> None:
        if self._closed:
            raise TransferError(f"transport {self.endpoint_id!r} is closed")
