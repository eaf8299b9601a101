"""A posted send or receive of one call's tensors; wait() completes it, with a timeout."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from splitserve.kvtransfer.errors import TransferError, TransportUsageError

_MIN_WAIT = timedelta(milliseconds=1)  # c10d reads a zero timeout as "wait forever"


class TransferOp:
    """Returned by KVTransport.isend/irecv (and used by send/recv).

    wait() returns the bytes moved, or raises TransferError; a failure (timeout, dead peer,
    closed pair) closes the whole pair, which also fails every other op posted on it.
    Waiting again returns the same result; a recv buffer is only valid after wait() returns.
    """

    def __init__(
        self, pair, works: list, num_bytes: int, sending: bool, tag: int, default_timeout_s: float, counted: bool = True
    ):
        self._pair = pair
        self._works = works
        self.num_bytes = num_bytes
        self.sending = sending
        self.tag = tag
        self.counted = counted  # handshakes are not part of the byte counters
        self._default_timeout_s = default_timeout_s
        self._posted_at = time.monotonic()
        self._lock = threading.Lock()
        self._completed = False
        self._error: TransferError | None = None

    @property
    def settled(self) -> bool:
        """True once wait() has returned or raised (the buffers are no longer in use)."""
        return self._completed or self._error is not None

    def wait(self, timeout_s: float | None = None) -> int:
        timeout_s = self._default_timeout_s if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise TransportUsageError(f"timeout_s must be > 0, got {timeout_s}")
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            raise TransferError(f"pair {self._pair.key}: another thread is still waiting on this op")
        try:
            if self._error is not None:
                raise self._error
            if self._completed:
                return self.num_bytes
            verb = "send" if self.sending else "recv"
            try:
                for work in self._works:
                    work.wait(max(timedelta(seconds=deadline - time.monotonic()), _MIN_WAIT))
            except RuntimeError as exc:  # timeouts, closed connections, DistBackendError
                self._error = TransferError(
                    f"pair {self._pair.key}: {verb} of {len(self._works)} tensor(s) with tag {self.tag} failed: {exc}"
                )
                self._pair.on_op_failed(self)
                raise self._error from exc
            self._completed = True
            self._pair.on_op_completed(self, time.monotonic() - self._posted_at)
            return self.num_bytes
        finally:
            self._lock.release()
