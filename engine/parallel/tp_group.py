"""TensorParallelGroup: one replica's tensor-parallel process group and the collectives the
sharded model runs on it, each bounded by a timeout.

A group of its own (a ProcessGroupGloo or ProcessGroupNCCL over the driver's TCPStore), not
torch's default group, so it never meets the KV-transfer groups (kvtransfer/process_groups.py)
a replica also opens. Gloo on CPU, NCCL on CUDA. Rank 0 is the driver: it schedules and samples.
On CPU the collectives go over a shared-memory segment of the ranks' node instead
(shm_collectives.py; EngineConfig.tensor_parallel_shm_collectives), gloo taking only what does
not fit its slots; the NCCL path never uses it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from splitserve.engine.config import ConfigError
from splitserve.engine.parallel.shard_plan import ShardPlan

if TYPE_CHECKING:
    from splitserve.engine.parallel.shm_collectives import ShmCollectives

DRIVER_RANK = 0


class TensorParallelError(RuntimeError):
    """A rank that did not join, failed to load, or a collective that did not complete in time."""


def rank_device(device: str, rank: int, size: int, own_device: bool = False) -> torch.device:
    """Rank r's device: CPU for a CPU engine. On CUDA, with own_device (a Ray rank actor: Ray
    sets each actor's CUDA_VISIBLE_DEVICES to the GPU it assigned it, so every rank sees its
    own GPU as cuda:0) the configured device in the rank's own view; otherwise (ranks spawned
    by one process that sees all the node's GPUs) the r-th GPU after the configured one
    (cuda = cuda:0). Too few GPUs is a one-line ConfigError."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    first = base.index or 0
    needed = first + 1 if own_device else first + size
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < needed:
        if own_device:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ConfigError(
                f"tensor-parallel rank {rank} of {size} sees {found} CUDA devices for {device} "
                f"(CUDA_VISIBLE_DEVICES={visible!r}): give the pool num_gpus 1 per rank"
            )
        raise ConfigError(
            f"tensor_parallel_size {size} from {device} needs {needed} CUDA devices on this node, it has {found}"
        )
    return base if own_device else torch.device("cuda", first + rank)


class TensorParallelGroup:
    def __init__(self, plan: ShardPlan, device: torch.device, process_group, timeout_s: float):
        self.plan = plan
        self.rank = plan.rank
        self.size = plan.size
        self.device = device
        self.process_group = process_group
        self.timeout = timedelta(seconds=timeout_s)
        self.shm: ShmCollectives | None = None  # the CPU collectives' shared memory, when in use

    @classmethod
    def join(
        cls,
        plan: ShardPlan,
        device: torch.device,
        store: dist.Store,
        host: str,
        timeout_s: float,
        shm_collectives: bool = True,
    ):
        """Build the group over store; gloo returns once every rank has joined (at most
        timeout_s), NCCL at its first collective. timeout_s also bounds every collective. On
        CPU with shm_collectives (the same on every rank), the ranks then map a shared-memory
        segment for their collectives; where it cannot be had they all stay on gloo."""
        timeout = timedelta(seconds=timeout_s)
        try:
            if device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                torch.cuda.set_device(device)
                group = dist.ProcessGroupNCCL(store, plan.rank, plan.size, options)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                options._timeout = timeout
                group = dist.ProcessGroupGloo(store, plan.rank, plan.size, options)
        except (RuntimeError, OSError) as exc:
            raise TensorParallelError(
                f"tensor-parallel rank {plan.rank} of {plan.size}: the group did not form in {timeout_s:.0f}s: {exc}"
            ) from exc
        joined = cls(plan, device, group, timeout_s)
        if device.type == "cpu" and shm_collectives and plan.size > 1:
            joined._open_shm(store)
        return joined

    def _open_shm(self, store: dist.Store) -> None:
        from splitserve.engine.parallel.shm_collectives import ShmCollectives, shm_supported

        if not shm_supported():
            return  # all ranks share the node, so all of them take this branch
        timeout_s = self.timeout.total_seconds()

        def agree(ok: bool) -> bool:  # every rank mapped the segment
            flags = torch.tensor([1 if ok else 0], dtype=torch.int32)
            self._wait(self.process_group.allreduce(flags, dist.ReduceOp.MIN, self.timeout), "shared-memory setup")
            return bool(flags.item())

        try:
            self.shm = ShmCollectives.open(self.rank, self.size, store, agree, timeout_s)
        except RuntimeError as exc:  # the store's wait for the segment's name (TensorParallelError is one too)
            self.shutdown()
            if isinstance(exc, TensorParallelError):
                raise
            raise TensorParallelError(
                f"tensor-parallel rank {self.rank} of {self.size}: no shared-memory segment within {timeout_s:.0f}s: {exc}"
            ) from exc

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER_RANK

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:  # a peer gone (connection closed) or the timeout passed
            raise TensorParallelError(f"tensor-parallel {what} on rank {self.rank} failed: {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum tensor over the ranks, in place (row-parallel outputs, the embedding)."""
        if self.shm is not None and self.shm.fits(tensor):  # else (larger than a slot) over gloo
            return self.shm.all_reduce(tensor)
        self._wait(self.process_group.allreduce(tensor, dist.ReduceOp.SUM, self.timeout), "all-reduce")
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The driver's tensor into every rank's (same shape and dtype), in place."""
        if self.shm is not None and self.shm.fits(tensor):
            return self.shm.broadcast(tensor)
        self._wait(self.process_group.broadcast(tensor, DRIVER_RANK, self.timeout), "broadcast")
        return tensor

    def gather_to_driver(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor (same shape), in rank order, on the driver; None elsewhere."""
        if self.shm is not None and self.shm.fits(tensor):
            return self.shm.gather_to_driver(tensor)
        outputs = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_driver else []
        self._wait(self.process_group.gather(outputs, tensor, DRIVER_RANK, self.timeout), "gather")
        return outputs if self.is_driver else None

    def shutdown(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        shutdown = getattr(self.process_group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass  # a peer already gone: nothing left to close cleanly
