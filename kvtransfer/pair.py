"""A pair: the KV connection between one sender (a prefill replica) and one receiver (a decode
replica), on its own standalone 2-rank process group, never the default group.

The group runs on the channel both ends agree on when they open the pair (pair_group.py): NCCL
across GPUs, gloo on CPU, and for two ends on one GPU CUDA IPC or host memory. Rank 0 is the
sender (prefill), rank 1 the receiver (decode). Ops are posted under the pair's lock, so the
tensors of one call go out (and are matched) in order; waiting happens outside it, so transfers
with distinct tags overlap. Any failure closes the pair: a half-done transfer leaves the stream
out of sync, so the caller reopens with a new epoch.
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
from splitserve.kvtransfer.kv_channel import SAME_DEVICE_MODES
from splitserve.kvtransfer.pair_group import OpenedGroup, open_pair_group
from splitserve.kvtransfer.transfer_op import TransferOp
from splitserve.kvtransfer.transfer_stats import TransferStats

logger = logging.getLogger(__name__)

ROLES = ("sender", "receiver")
HANDSHAKE_TAG = 2**31 - 1  # reserved tags; user tags are below them
INTERRUPT_TAG = 2**31 - 2
MAX_USER_TAG = INTERRUPT_TAG - 1


class Pair:
    """An open pair with one peer (one epoch of it); built by Pair.open, used through KVTransport."""

    def __init__(
        self,
        peer_id: str,
        role: str,
        epoch: int,
        key: str,
        device: torch.device,
        opened: OpenedGroup,
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
        self.channel = opened.channel  # nccl | gloo | ipc | host
        self.fallback_reason = opened.fallback_reason
        process_group = opened.group
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
        same_device: str = "auto",
    ) -> Pair:
        """Open the pair (both sides call this concurrently): join its process group, then
        exchange the handshake (the epoch, sender to receiver).

        same_device: how a pair whose ends share one device moves tensors (kv_channel.py)."""
        if same_device not in SAME_DEVICE_MODES:
            raise ValueError(f"same_device must be one of {SAME_DEVICE_MODES}, got {same_device!r}")
        started = time.monotonic()
        store.set_timeout(timedelta(seconds=timeout_s))
        try:
            rank = 0 if role == "sender" else 1
            opened = open_pair_group(store, rank, device, host, same_device, timeout_s, op_timeout_s, HANDSHAKE_TAG)
        except TransferError as exc:
            raise TransferError(f"pair {key}: {exc}") from exc
        except (RuntimeError, OSError) as exc:  # DistStoreError on timeout, gloo connect errors
            raise TransferError(f"pair {key}: peer {peer_id!r} did not join within {timeout_s:.1f}s: {exc}") from exc
        pair = cls(peer_id, role, epoch, key, device, opened, store, default_timeout_s, on_stats)
        # Also creates NCCL's communicator, which is lazy; on gloo it proves the pair works.
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
            if self.channel == "nccl":
                process_group.abort()  # fails pending works, frees the communicator
            else:
                if has_pending:  # ipc and host pairs wait on their gloo control group
                    self._interrupt_gloo(getattr(process_group, "control", process_group))
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
