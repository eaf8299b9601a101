"""Which channel a pair's tensors travel on, decided from what each end reports about its device.

    nccl  CUDA tensors on two different GPUs (NCCL refuses two ranks on one device)
    gloo  CPU tensors (gloo over TCP; on one host that is loopback)
    ipc   both ends on one device: the receiver shares its buffers (CUDA IPC handles, or shared
          memory for CPU tensors) and the sender copies straight into them
    host  both ends on one device, through host memory: CUDA tensors are staged in host buffers
          and moved by gloo; the fallback when CUDA IPC does not work between the two processes

Each end publishes a DeviceIdentity in the pair's store; both run choose_channel on the same two
records, so they agree without another message. The sender's `same_device` mode decides:

    auto  (default) CUDA on one GPU: ipc, falling back to host if IPC fails; CPU: gloo
    ipc   ipc on either device type, falling back to host (with a warning) if it fails; CPU
          tensors are shared by file name, so both processes need torch.multiprocessing's
          'file_system' sharing strategy (receive buffers outside shared memory get a bounce buffer)
    host  host for same-device pairs
"""

from __future__ import annotations

import functools
import json
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from splitserve.kvtransfer.errors import TransferError, TransportUsageError

CHANNELS = ("nccl", "gloo", "ipc", "host")
SAME_DEVICE_MODES = ("auto", "ipc", "host")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class DeviceIdentity:
    """Where one end's tensors live: host (hostname and boot id) and device (a GPU's UUID, or "cpu")."""

    host: str
    device_type: str  # "cpu" or "cuda"
    device: str
    same_device: str = "auto"

    def __post_init__(self) -> None:
        if self.same_device not in SAME_DEVICE_MODES:
            raise TransportUsageError(f"same_device must be one of {SAME_DEVICE_MODES}, got {self.same_device!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> DeviceIdentity:
        try:
            return cls(**json.loads(raw))
        except (TypeError, ValueError) as exc:
            raise TransferError(f"the peer sent an unreadable device identity {raw!r}: {exc}") from None


@functools.cache
def host_id() -> str:
    """hostname plus the kernel's boot id: two containers named alike on different nodes differ."""
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def cuda_device_id(index: int) -> str:
    """A GPU's UUID: the same physical GPU whatever CUDA_VISIBLE_DEVICES numbers it as."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return f"GPU-{uuid}" if not uuid.startswith("GPU-") else uuid
    pci = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(value is not None for value in pci):
        return "pci-{}:{}:{}".format(*pci)
    raise TransferError(f"cannot identify CUDA device {index}: its properties carry neither a UUID nor a PCI id")


def local_identity(device, same_device: str = "auto") -> DeviceIdentity:
    """This process's identity for a torch.device (a CUDA device must carry its index)."""
    if device.type == "cuda":
        return DeviceIdentity(host_id(), "cuda", cuda_device_id(device.index), same_device)
    if device.type == "cpu":
        return DeviceIdentity(host_id(), "cpu", "cpu", same_device)
    raise TransportUsageError(f"KV transfer moves cpu or cuda tensors, not {device.type}")


def choose_channel(sender: DeviceIdentity, receiver: DeviceIdentity) -> str:
    """The channel both ends use; the sender's same_device mode decides for same-device pairs."""
    if sender.device_type != receiver.device_type:
        raise TransferError(
            f"the sender moves {sender.device_type} tensors but the receiver {receiver.device_type} tensors; "
            "both ends of a pair must hold their KV cache on the same kind of device"
        )
    same_device = sender.host == receiver.host and sender.device == receiver.device
    if not same_device:
        return "nccl" if sender.device_type == "cuda" else "gloo"
    mode = sender.same_device
    if mode == "host":
        return "host"
    if mode == "ipc" or sender.device_type == "cuda":
        return "ipc"
    return "gloo"
