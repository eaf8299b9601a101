"""The `ipc` channel: a same-device pair where the receiver shares its buffers and the sender copies.

NCCL refuses two ranks on one GPU, yet a prefill and a decode replica on one GPU is a real
deployment (small models, fractional GPUs). For such a pair the receiver shares each posted
buffer (a CUDA IPC handle, or a shared-memory file for CPU tensors; ipc_buffers.py) and the
sender copies its tensor straight into it: one device-to-device copy, no host
hop. A gloo group (`control`) carries two small frames per tensor, under the op's own tag:

    receiver, at post   record an IPC event on its stream (all earlier work that touches the
                        buffer), send HANDLE(seq, handle, event); post a recv for DONE
    sender, at wait     recv HANDLE, open the handle, wait for the event on a side stream,
                        copy, synchronize that stream, send DONE(seq)
    receiver, at wait   DONE has arrived: the data is in its buffer

Gloo matches one tag's messages in posting order; the sender also completes one tag's ops in
posting order (whichever op is waited on first), so the k-th send fills the k-th receive, as on
gloo or NCCL. The data moves when the sender waits, which KVSender and KVTransport.send always
do. Both ends check the sequence number and shape in every frame. A failure to share or open a
buffer raises IpcUnavailableError on both ends; the pair opening then falls back to `host`.
"""

from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta

import torch

from splitserve.kvtransfer.ipc_buffers import BufferExporter, BufferImporter, IpcUnavailableError

__all__ = ["FRAME_BYTES", "IpcGroup", "IpcUnavailableError"]

FRAME_BYTES = 4096
_OK, _SHARE_FAILED, _OPEN_FAILED, _MISMATCH = 0, 1, 2, 3
_HEADER = 13  # status (1 byte), seq (8), payload length (4)


def _frame(status: int, seq: int, payload: bytes = b"") -> torch.Tensor:
    if _HEADER + len(payload) > FRAME_BYTES:
        raise IpcUnavailableError(f"a sharing handle of {len(payload)} bytes exceeds the {FRAME_BYTES}-byte frame")
    raw = bytes([status]) + seq.to_bytes(8, "little") + len(payload).to_bytes(4, "little") + payload
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    frame[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return frame


def _read_frame(frame: torch.Tensor) -> tuple[int, int, bytes]:
    raw = frame.numpy().tobytes()
    length = int.from_bytes(raw[9:13], "little")
    return raw[0], int.from_bytes(raw[1:9], "little"), raw[_HEADER : _HEADER + length]


class _RecvWork:
    def __init__(self, group: IpcGroup, target, tensor: torch.Tensor, seq: int, handle_send, done_recv, done, keep):
        self._group, self._target, self._tensor, self._seq = group, target, tensor, seq
        self._handle_send, self._done_recv, self._done = handle_send, done_recv, done
        self._keep = keep  # the IPC event must live until the sender has opened it

    def wait(self, timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        self._handle_send.wait(_remaining(deadline))
        self._done_recv.wait(_remaining(deadline))
        status, seq, payload = _read_frame(self._done)
        self._keep = None
        if status != _OK:
            raise IpcUnavailableError(payload.decode(errors="replace") or f"the sender failed with status {status}")
        if seq != self._seq:
            raise RuntimeError(f"ipc channel out of sync: DONE for op {seq}, expected {self._seq}")
        if self._tensor is not self._target:
            self._target.copy_(self._tensor)
            self._tensor = self._target
        return True


class _SendWork:
    def __init__(self, group: IpcGroup, tensor: torch.Tensor, tag: int, seq: int, handle_recv, frame):
        self._group, self._tensor, self._tag, self._seq = group, tensor, tag, seq
        self._handle_recv, self._frame = handle_recv, frame
        self._done_send = None
        self._error: BaseException | None = None

    def wait(self, timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        lock = self._group.tag_lock(self._tag)
        if not lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise RuntimeError(f"ipc send with tag {self._tag}: timed out behind an earlier send of that tag")
        try:
            queue = self._group.pending_sends(self._tag)
            while self._done_send is None and self._error is None:
                head = queue[0]  # this op is queued until it completes, so the queue is not empty
                try:
                    head.complete(deadline)
                except BaseException as exc:
                    for work in queue:  # the tag's stream is out of step now
                        work._error = exc
                    queue.clear()
                    break
                queue.popleft()
        finally:
            lock.release()
        if self._error is not None:
            raise self._error
        self._done_send.wait(_remaining(deadline))
        return True

    def complete(self, deadline: float) -> None:
        """Receive the peer's handle, copy into it, tell the peer (called in posting order)."""
        self._handle_recv.wait(_remaining(deadline))
        status, seq, payload = _read_frame(self._frame)
        if status != _OK:
            reason = payload.decode(errors="replace")
            self._fail(
                deadline, _SHARE_FAILED, IpcUnavailableError(f"the receiver could not share its buffer: {reason}")
            )
        if seq != self._seq:
            self._fail(
                deadline, _MISMATCH, RuntimeError(f"ipc channel out of sync: HANDLE for op {seq}, expected {self._seq}")
            )
        try:
            dst, ready = self._group.importer.open(payload)
        except Exception as exc:
            reason = f"cannot open the receiver's buffer: {type(exc).__name__}: {exc}"
            self._fail(deadline, _OPEN_FAILED, IpcUnavailableError(reason))
        if dst.shape != self._tensor.shape or dst.dtype != self._tensor.dtype:
            sent = self._tensor
            reason = f"receive buffer {dst.dtype} {tuple(dst.shape)} != sent {sent.dtype} {tuple(sent.shape)}"
            self._fail(deadline, _MISMATCH, RuntimeError(reason))
        self._group.copy(dst, self._tensor, ready)
        self._send_done(_OK)

    def _send_done(self, status: int, payload: bytes = b"") -> None:
        frame = _frame(status, self._seq, payload[: FRAME_BYTES - _HEADER])
        self._done_send = self._group.control.send([frame], self._group.peer_rank, self._tag)

    def _fail(self, deadline: float, status: int, error: BaseException) -> None:
        """Tell the receiver why (its op fails too, and the tag stays in step), then raise."""
        self._send_done(status, str(error).encode())
        self._done_send.wait(_remaining(deadline))
        raise error


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


class IpcGroup:
    """send/recv of one tensor per call between the two ranks, with gloo-like work objects."""

    def __init__(self, control, rank: int, device: torch.device):
        self.control = control
        self.rank = rank
        self.peer_rank = 1 - rank
        self.device = device
        self._lock = threading.Lock()
        self._send_seq: dict[int, int] = collections.defaultdict(int)
        self._recv_seq: dict[int, int] = collections.defaultdict(int)
        self._tag_locks: dict[int, threading.Lock] = {}
        self._pending: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.exporter = BufferExporter(device)  # used by the receiving rank
        self.importer = BufferImporter(device)  # used by the sending rank
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _RecvWork:
        (target,) = tensors
        tensor = target
        if target.device.type == "cpu" and not target.is_shared():
            # Only shared memory can be opened by the peer: land there, copy over in wait().
            tensor = torch.empty_like(target).share_memory_()
        with self._lock:
            seq = self._recv_seq[tag]
            self._recv_seq[tag] += 1
        try:
            payload, keep = self.exporter.describe(tensor)
            frame = _frame(_OK, seq, payload)
        except Exception as exc:  # still send a frame: the sender is waiting for one
            reason = str(exc) if isinstance(exc, IpcUnavailableError) else f"{type(exc).__name__}: {exc}"
            keep, frame = None, _frame(_SHARE_FAILED, seq, reason.encode()[:2048])
        handle_send = self.control.send([frame], src, tag)
        done = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        done_recv = self.control.recv([done], src, tag)
        return _RecvWork(self, target, tensor, seq, handle_send, done_recv, done, (keep, frame))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _SendWork:
        (tensor,) = tensors
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        with self._lock:
            seq = self._send_seq[tag]
            self._send_seq[tag] += 1
            handle_recv = self.control.recv([frame], dst, tag)
            work = _SendWork(self, tensor, tag, seq, handle_recv, frame)
            self._pending[tag].append(work)
        return work

    def tag_lock(self, tag: int) -> threading.Lock:
        with self._lock:
            return self._tag_locks.setdefault(tag, threading.Lock())

    def pending_sends(self, tag: int) -> collections.deque:
        return self._pending[tag]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, ready) -> None:
        """dst <- src and wait until it landed; on CUDA after the receiver's event, on a side stream."""
        if self._copy_stream is None:
            dst.copy_(src)
            return
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # src is written on the current stream
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    def shutdown(self) -> None:
        self.importer.close()
        self.control.shutdown()
