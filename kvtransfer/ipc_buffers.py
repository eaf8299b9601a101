"""Receive buffers of the `ipc` channel: shared by the receiver, opened by the sender.

Sharing works per storage (one allocation), not per tensor, and each storage is shared once for
as long as it lives: torch wraps a CUDA storage in a new reference-counted IPC context on every
`_share_cuda_`, so sharing the KV cache on every op would grow without bound. The sender opens
each share once and keeps it mapped; the receiver lists the shares of storages it has freed since
its last frame, and the sender unmaps those, which lets the receiver's allocator reuse the memory
(torch holds a freed storage that a peer still maps "in limbo" until then).

CUDA storages are shared by IPC handle; CPU storages must live in shared memory (IpcGroup gives
other receive buffers a bounce buffer there) and are shared by file name (torch.multiprocessing's
'file_system' strategy).
"""

from __future__ import annotations

import itertools
import pickle
import threading
from dataclasses import dataclass, field

import torch

_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)}
_DTYPES.update({str(t): t for t in (torch.float64, torch.int32, torch.int16, torch.int8, torch.bool)})


class IpcUnavailableError(RuntimeError):
    """A buffer could not be shared with, or opened by, the peer process."""


@dataclass
class BufferDescription:
    """What one HANDLE frame carries: where the tensor lives, plus shares freed since the last."""

    share_id: int
    share: tuple  # storage._share_cuda_() or _share_filename_cpu_()
    device_type: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    event: bytes | None = None  # CUDA: IPC event recorded after the receiver's earlier work
    released: list[int] = field(default_factory=list)


class BufferExporter:
    """Receiver side: describe tensors so that the peer can write into them."""

    def __init__(self, device: torch.device):
        self.device = device
        self._ids = itertools.count()
        self._shares: dict[int, tuple] = {}  # StorageImpl address -> (weak ref, share id, share)
        self._collect = False

    def describe(self, tensor: torch.Tensor) -> tuple[bytes, object]:
        """The frame payload for tensor, and what must stay alive until the peer opened it."""
        from torch.multiprocessing.reductions import StorageWeakRef

        released = self._prune()
        storage = tensor.untyped_storage()
        entry = self._shares.get(storage._cdata)
        if entry is None:
            entry = (StorageWeakRef(storage), next(self._ids), self._share(storage))
            self._shares[storage._cdata] = entry
        _, share_id, share = entry
        event = None
        if tensor.is_cuda:
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(tensor.device))
        description = BufferDescription(
            share_id,
            share,
            tensor.device.type,
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            str(tensor.dtype),
            None if event is None else bytes(event.ipc_handle()),
            released,
        )
        return pickle.dumps(description), event

    def _share(self, storage: torch.UntypedStorage) -> tuple:
        if storage.device.type == "cuda":
            return storage._share_cuda_()
        import torch.multiprocessing as mp

        strategy = mp.get_sharing_strategy()
        if strategy != "file_system":
            raise IpcUnavailableError(
                "CPU tensors are shared through named files: call torch.multiprocessing."
                f"set_sharing_strategy('file_system') in both processes (this one uses {strategy!r})"
            )
        if not storage.is_shared():
            raise IpcUnavailableError("a CPU receive buffer must live in shared memory (share_memory_())")
        return storage._share_filename_cpu_()

    def _prune(self) -> list[int]:
        """Forget shares whose storage is gone; their ids go to the peer, which unmaps them."""
        if self._collect and self.device.type == "cuda":
            torch.cuda.ipc_collect()  # frees storages the peer unmapped after the previous frame
        dead = [key for key, (weak, _, _) in self._shares.items() if weak.expired()]
        released = [self._shares.pop(key)[1] for key in dead]
        self._collect = bool(released)
        return released


class BufferImporter:
    """Sender side: open the peer's buffers (each share once) as tensors of this process."""

    def __init__(self, device: torch.device):
        self.device = device
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._lock = threading.Lock()  # sends of different tags complete in different threads

    @property
    def num_mapped(self) -> int:
        return len(self._storages)

    def open(self, payload: bytes) -> tuple[torch.Tensor, object]:
        """The described tensor, and the CUDA event to wait for before writing it (or None)."""
        description: BufferDescription = pickle.loads(payload)
        if description.device_type != self.device.type:
            raise IpcUnavailableError(f"the peer shares {description.device_type} memory, this end moves {self.device}")
        with self._lock:  # each share is opened exactly once: its reference count expects one holder
            for share_id in description.released:
                self._storages.pop(share_id, None)
            storage = self._storages.get(description.share_id)
            if storage is None:
                storage = self._open_storage(description.share)
                self._storages[description.share_id] = storage
        dtype = _DTYPES.get(description.dtype)
        if dtype is None:
            raise IpcUnavailableError(f"unsupported dtype {description.dtype} for the ipc channel")
        tensor = torch.empty(0, dtype=dtype, device=self.device)
        tensor.set_(storage, description.offset, description.shape, description.stride)
        ready = None
        if description.event is not None:
            ready = torch.cuda.Event.from_ipc_handle(self.device, description.event)
        return tensor, ready

    def _open_storage(self, share: tuple) -> torch.UntypedStorage:
        if self.device.type == "cuda":
            # The peer numbers the GPU as it sees it; this process may number it differently.
            return torch.UntypedStorage._new_shared_cuda(self.device.index, *share[1:])
        return torch.UntypedStorage._new_shared_filename_cpu(*share)

    def close(self) -> None:
        with self._lock:
            self._storages.clear()
