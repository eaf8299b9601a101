"""splitserve KV transfer: paged KV blocks from prefill to decode workers over torch.distributed.

Each (prefill, decode) pair gets its own 2-rank process group (NCCL on GPU, gloo on CPU),
opened lazily through the sender's TCPStore and torn down when idle.

The names below load on first use, so torch-free callers (the router, the frontends) can import
kvtransfer.handoff without importing torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "KVTransport": "kvtransfer.transport",
    "resolve_host": "kvtransfer.rendezvous",
    "pair_key": "kvtransfer.rendezvous",
    "Pair": "kvtransfer.pair",
    "TransferOp": "kvtransfer.transfer_op",
    "TransferStats": "kvtransfer.transfer_stats",
    "TransferError": "kvtransfer.errors",
    "TransportUsageError": "kvtransfer.errors",
    "send_blocks": "kvtransfer.block_transfer",
    "recv_blocks": "kvtransfer.block_transfer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
