"""A pair's process group, opened on the channel both ends agree on (splitserve.kvtransfer.kv_channel).

Both ends publish their DeviceIdentity in the pair's store and read the peer's, pick the channel,
then build its group: NCCL, gloo, or a gloo control group under the same-device `ipc` or `host`
channel. An `ipc` pair probes IPC with one small tensor first; when the receiver cannot share or
the sender cannot open it, both ends see the failure and fall back to `host` (logged, with the
reason), on the same control group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.host_staged_group import HostStagedGroup
from splitserve.kvtransfer.ipc_group import IpcGroup, IpcUnavailableError
from splitserve.kvtransfer.kv_channel import DeviceIdentity, choose_channel, local_identity

logger = logging.getLogger(__name__)

_PROBE_VALUE = 0x5EED5EED


@dataclass
class OpenedGroup:
    """A pair's process group as opened: the group, its channel, and why it fell back."""

    group: object  # what Pair posts on: send/recv returning works with wait(timedelta)
    channel: str
    fallback_reason: str | None = None  # why an ipc pair runs on host instead


def exchange_identities(store: dist.Store, rank: int, device: torch.device, same_device: str) -> str:
    """Publish this end's identity, read the peer's (waits up to the store's timeout), pick the channel."""
    local = local_identity(device, same_device)
    store.set(f"identity/{rank}", local.to_json())
    peer = DeviceIdentity.from_json(store.get(f"identity/{1 - rank}"))
    sender, receiver = (local, peer) if rank == 0 else (peer, local)
    return choose_channel(sender, receiver)


def open_pair_group(
    store: dist.Store,
    rank: int,
    device: torch.device,
    host: str,
    same_device: str,
    join_timeout_s: float,
    op_timeout_s: float,
    probe_tag: int,
) -> OpenedGroup:
    """Gloo blocks until both ranks have joined, for at most join_timeout_s; NCCL joins lazily,
    at the first op, and its group timeout is the age at which its watchdog acts on an op.
    probe_tag: a reserved tag for the ipc probe (the pair's handshake tag: the probe is the
    first op on it, and a tag's messages are matched in order)."""
    started = time.monotonic()
    channel = exchange_identities(store, rank, device, same_device)
    if channel == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise TransferError("this torch build has no NCCL; cannot transfer CUDA tensors")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timedelta(seconds=op_timeout_s)
        return OpenedGroup(dist.ProcessGroupNCCL(store, rank, 2, options), channel)
    control = _gloo_group(store, rank, host, join_timeout_s)
    if channel == "gloo":
        return OpenedGroup(control, channel)
    if channel == "host":
        return OpenedGroup(HostStagedGroup(control, device), channel)
    ipc = IpcGroup(control, rank, device)
    remaining_s = max(join_timeout_s - (time.monotonic() - started), 0.001)
    reason = _probe(ipc, rank, device, remaining_s, probe_tag)
    if reason is None:
        return OpenedGroup(ipc, channel)
    logger.warning("CUDA IPC/shared memory does not work for this same-device pair (%s); using host memory", reason)
    return OpenedGroup(HostStagedGroup(control, device), "host", reason)


def _gloo_group(store: dist.Store, rank: int, host: str, join_timeout_s: float):
    options = dist.ProcessGroupGloo._Options()
    # An explicit device pins gloo to this host's address (loopback in tests, the node IP in a
    # cluster) instead of whatever the hostname resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    # Gloo waits this long for the peer's rendezvous keys; every op passes its own timeout.
    options._timeout = timedelta(seconds=join_timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _probe(ipc: IpcGroup, rank: int, device: torch.device, timeout_s: float, tag: int) -> str | None:
    """Move one value sender -> receiver over IPC: None if it arrived, else why not. The receiver
    then sends its verdict, so both ends decide alike (a share or open failure already reaches
    the other end in its frame; a wrong value only the receiver can see)."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        token = torch.tensor([_PROBE_VALUE], dtype=torch.int64, device=device)
        work = ipc.send([token], 1, tag)
    else:
        token = torch.zeros(1, dtype=torch.int64, device=device)
        work = ipc.recv([token], 0, tag)
    reason = None
    try:
        work.wait(_remaining(deadline))
    except IpcUnavailableError as exc:
        reason = str(exc)
    except RuntimeError as exc:
        raise TransferError(f"the same-device probe failed: {exc}") from exc
    if rank == 1 and reason is None and int(token.item()) != _PROBE_VALUE:
        reason = f"the probe value arrived as {int(token.item())}"
    verdict = torch.tensor([0 if reason is None else 1], dtype=torch.int64)
    try:
        if rank == 1:
            ipc.control.send([verdict], 0, tag).wait(_remaining(deadline))
        else:
            ipc.control.recv([verdict], 1, tag).wait(_remaining(deadline))
    except RuntimeError as exc:
        raise TransferError(f"the same-device probe's verdict did not arrive: {exc}") from exc
    if reason is None and int(verdict.item()) != 0:
        reason = "the receiver did not see the probe value"
    return reason


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))
