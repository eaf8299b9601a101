"""splitserve KV transfer: paged KV blocks from prefill to decode workers over torch.distributed.

Each (prefill, decode) pair gets its own 2-rank process group (NCCL between GPUs, gloo on CPU,
CUDA IPC or host memory when both ends share one GPU; see kv_channel.py), opened lazily through
the sender's TCPStore and torn down when idle.

Only the KV data plane lives here; the messages that cross processes (the handoff, poll
replies) are splitserve.proto.messages. The names below load on first use, so importing one
submodule (e.g. splitserve.kvtransfer.errors) does not import torch through this package.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "KVTransport": "splitserve.kvtransfer.transport",
    "resolve_host": "splitserve.kvtransfer.host_address",
    "pair_key": "splitserve.kvtransfer.rendezvous",
    "Pair": "splitserve.kvtransfer.pair",
    "TransferOp": "splitserve.kvtransfer.transfer_op",
    "TransferStats": "splitserve.kvtransfer.transfer_stats",
    "TransferError": "splitserve.kvtransfer.errors",
    "TransportUsageError": "splitserve.kvtransfer.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'splitserve.kvtransfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
