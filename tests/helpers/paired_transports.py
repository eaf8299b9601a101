"""Two KVTransport endpoints in this process with one pair open between them (prefill sends,
decode receives), over gloo or one of the same-device channels: the pair the KV-sending test
modules run every case over."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from splitserve.kvtransfer import KVTransport

# KVTransport's same_device settings, and the channel each one opens between two CPU endpoints.
SAME_DEVICE = ["auto", "ipc", "host"]
CHANNEL_OF = {"auto": "gloo", "ipc": "ipc", "host": "host"}


@contextlib.contextmanager
def paired_transports(name: str, same_device: str, timeout_s: float) -> Iterator[tuple[KVTransport, KVTransport]]:
    """(prefill, decode) endpoints named <name>-prefill and <name>-decode, their pair open on the
    channel `same_device` asks for (asserted); both closed on exit."""
    previous = torch.multiprocessing.get_sharing_strategy()
    # The ipc channel shares CPU tensors by file name: it refuses any other strategy.
    torch.multiprocessing.set_sharing_strategy("file_system")
    prefill = KVTransport(f"{name}-prefill", "cpu", timeout_s=timeout_s, same_device=same_device)
    decode = KVTransport(f"{name}-decode", "cpu", timeout_s=timeout_s)
    try:
        joined = threading.Thread(target=prefill.open_pair, args=(f"{name}-decode", None, "sender", 0))
        joined.start()
        channel = decode.open_pair(f"{name}-prefill", prefill.address, "receiver", 0).channel
        joined.join(timeout_s)
        assert channel == CHANNEL_OF[same_device]
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()
        torch.multiprocessing.set_sharing_strategy(previous)
