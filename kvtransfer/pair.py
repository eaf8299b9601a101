"""One (sender, receiver) connection: a standalone 2-rank process group, never the default group.

Rank 0 is the sender (prefill), rank 1 the receiver (decode). Ops are posted under the pair's
lock, so the tensors of one call go out (and are matched) in order; waiting happens outside
it, so transfers with distinct tags overlap. Any failure closes the pair: a half-done transfer
leaves the stream out of sync, so the caller reopens with a new epoch.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.transfer_op import TransferOp
from splitserve.kvtransfer.transfer_stats import TransferStats

logger = logging.getLogger(__name__)

ROLES = ("sender", "receiver")
HANDSHAKE_TAG = 2**31 - 1  # reserved tags; user tags are below them
INTERRUPT_TAG = 2**31 - 2
MAX_USER_TAG = INTERRUPT_TAG - 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _create_process_group(
    store: dist.Store, rank: int, device: torch.device, host: str, join_timeout_s: float, op_timeout_s: float
):
    """Gloo blocks until both ranks have joined, for at most join_timeout_s; NCCL joins lazily,
    at the first op, and its group timeout is the age at which its watchdog acts on an op."""
    if backend_for(device) == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise TransferError("this torch build has no NCCL; cannot transfer CUDA tensors")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timedelta(seconds=op_timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    # An explicit device pins gloo to this host's address (loopback in tests, the node IP in a
    # cluster) instead of whatever the hostname resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    # Gloo waits this long for the peer's rendezvous keys; every op passes its own timeout.
    options._timeout = timedelta(seconds=join_timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, options)


class Pair:
    """An open 2-rank group with one peer; built by Pair.open, used through KVTransport."""

    def __init__(
        self,
        peer_id: str,
        role: str,
        epoch: int,
        key: str,
        device: torch.device,
        process_group,
        store: dist.Store,
        default_timeout_s: float,
        on_stats: Callable[[TransferStats], None] | None = None,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.peer_id = peer_id
        self.role = role
        self.epoch = epoch
        self.key = key
        self.device = device
        self.backend = backend_for(device)
        self.rank = 0 if role == "sender" else 1
        self.peer_rank = 1 - self.rank
        self.default_timeout_s = default_timeout_s
        self._process_group = process_group
        self._store = store  # the backend may read it again; keep it with the group
        self._lock = threading.Lock()  # guards the group, posting order and the pending set
        self._pending: weakref.WeakSet[TransferOp] = weakref.WeakSet()
        self._stats = TransferStats()
        self._on_stats = on_stats
        self._last_used = time.monotonic()

    @classmethod
    def open(
        cls,
        peer_id: str,
        role: str,
        epoch: int,
        key: str,
        device: torch.device,
        store: dist.Store,
        host: str,
        timeout_s: float,
        op_timeout_s: float,
        default_timeout_s: float,
        on_stats: Callable[[TransferStats], None] | None = None,
    ) -> Pair:
        """Join the group (both sides call this concurrently), then exchange a handshake."""
        started = time.monotonic()
        store.set_timeout(timedelta(seconds=timeout_s))
        try:
            process_group = _create_process_group(
                store, 0 if role == "sender" else 1, device, host, timeout_s, op_timeout_s
            )
        except TransferError:
            raise
        except (RuntimeError, OSError) as exc:  # DistStoreError on timeout, gloo connect errors
            raise TransferError(f"pair {key}: peer {peer_id!r} did not join within {timeout_s:.1f}s: {exc}") from exc
        pair = cls(peer_id, role, epoch, key, device, process_group, store, default_timeout_s, on_stats)
        # Also creates NCCL's communicator, which is lazy; on gloo it proves the link works.
        token = torch.tensor([epoch], dtype=torch.int64, device=device)
        remaining_s = max(timeout_s - (time.monotonic() - started), 0.001)
        try:
            pair.post([token], HANDSHAKE_TAG, sending=role == "sender", counted=False).wait(remaining_s)
        except TransferError as exc:
            raise TransferError(f"pair {key}: handshake with {peer_id!r} failed: {exc}") from exc
        if role == "receiver" and int(token.item()) != epoch:
            pair.close()
            raise TransferError(f"pair {key}: handshake carried epoch {int(token.item())}")
        pair._record(TransferStats(num_pairs_opened=1))
        return pair

    @property
    def is_open(self) -> bool:
        return self._process_group is not None

    @property
    def idle_seconds(self) -> float:
        return time.monotonic() - self._last_used

    @property
    def num_pending(self) -> int:
        return sum(1 for op in list(self._pending) if not op.settled)

    def stats(self) -> TransferStats:
        with self._lock:
            return self._stats.copy()

    def post(self, tensors: list[torch.Tensor], tag: int, sending: bool, counted: bool = True) -> TransferOp:
        """Post one op per non-empty tensor (both sides skip the same empty buffers)."""
        tensors = [t for t in tensors if t.numel() > 0]
        with self._lock:
            if self._process_group is None:
                raise TransferError(f"pair {self.key} is closed")
            try:
                if sending:
                    works = [self._process_group.send([t], self.peer_rank, tag) for t in tensors]
                else:
                    works = [self._process_group.recv([t], self.peer_rank, tag) for t in tensors]
            except RuntimeError as exc:  # gloo reports a dead peer already at post time
                failure = exc
            else:
                failure = None
                op = TransferOp(
                    self, works, sum(t.nbytes for t in tensors), sending, tag, self.default_timeout_s, counted
                )
                self._pending.add(op)
                self._last_used = time.monotonic()
        if failure is not None:
            self._record(TransferStats(num_failures=1))
            self.close()
            raise TransferError(f"pair {self.key}: posting tag {tag} failed: {failure}") from failure
        return op

    def on_op_completed(self, op: TransferOp, seconds: float) -> None:
        self._last_used = time.monotonic()
        if not op.counted:
            return
        if op.sending:
            self._record(TransferStats(bytes_sent=op.num_bytes, seconds_sending=seconds, num_sends=1))
        else:
            self._record(TransferStats(bytes_received=op.num_bytes, seconds_receiving=seconds, num_recvs=1))

    def on_op_failed(self, op: TransferOp) -> None:
        if op.counted:
            self._record(TransferStats(num_failures=1))
        self.close()

    def close(self) -> None:
        """Tear the group down now; ops still pending on it fail promptly with TransferError."""
        with self._lock:
            process_group, self._process_group = self._process_group, None
            has_pending = self.num_pending > 0
        if process_group is not None:
            self._teardown(process_group, has_pending)

    def close_if_idle(self, max_idle_s: float) -> bool:
        """Close unless an op is pending or the pair was used within max_idle_s."""
        with self._lock:
            if self._process_group is None or self.num_pending or self.idle_seconds < max_idle_s:
                return False
            process_group, self._process_group = self._process_group, None
        self._teardown(process_group, has_pending=False)
        return True

    def _record(self, delta: TransferStats) -> None:
        with self._lock:
            self._stats.add(delta)
        if self._on_stats is not None:
            self._on_stats(delta)

    def _teardown(self, process_group, has_pending: bool) -> None:
        try:
            if self.backend == "nccl":
                process_group.abort()  # fails pending works, frees the communicator
            else:
                if has_pending:
                    self._interrupt_gloo(process_group)
                process_group.shutdown()
        except RuntimeError as exc:  # already broken; the sockets close with the object anyway
            logger.debug("pair %s: teardown raised %s", self.key, exc)
        self._store = None

    def _interrupt_gloo(self, process_group) -> None:
        # Gloo's shutdown does not wake ops blocked in wait(), but a timed-out wait closes the
        # connection, which fails every op pending on it here and at the peer right away.
        probe = torch.empty(1)
        try:
            process_group.recv([probe], self.peer_rank, INTERRUPT_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass
