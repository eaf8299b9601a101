"""The `host` channel: a same-device pair moving tensors through host memory over gloo.

The fallback when CUDA IPC does not work between a pair's two processes (e.g. containers that
do not share an IPC namespace), and what `same_device="host"` asks for. A send copies the
tensor to host memory first; a receive lands in a host buffer that wait() copies into the
destination. Gloo matches the messages, so ordering and timeouts are gloo's. On CPU tensors it
is plain gloo plus one copy per receive, which is how CPU tests run it.
"""

from __future__ import annotations

from datetime import timedelta

import torch


class _StagedRecv:
    def __init__(self, work, staging: torch.Tensor, target: torch.Tensor):
        self._work, self._staging, self._target = work, staging, target

    def wait(self, timeout: timedelta) -> bool:
        self._work.wait(timeout)
        if self._staging is not None:
            self._target.copy_(self._staging)  # blocking: the data is in place when wait returns
            self._staging = None
        return True


class _StagedSend:
    def __init__(self, work, staging: torch.Tensor):
        self._work, self._staging = work, staging  # gloo reads staging until the send completes

    def wait(self, timeout: timedelta) -> bool:
        self._work.wait(timeout)
        self._staging = None
        return True


class HostStagedGroup:
    """send/recv like a gloo group, for tensors of any device."""

    def __init__(self, control, device: torch.device):
        self.control = control
        self.device = device
        self._pin = device.type == "cuda"

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self._pin)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _StagedSend:
        (tensor,) = tensors
        staging = self._host_buffer(tensor)
        staging.copy_(tensor)  # waits for the work that wrote tensor on its stream
        return _StagedSend(self.control.send([staging], dst, tag), staging)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _StagedRecv:
        (tensor,) = tensors
        staging = self._host_buffer(tensor)
        return _StagedRecv(self.control.recv([staging], src, tag), staging, tensor)

    def shutdown(self) -> None:
        self.control.shutdown()
