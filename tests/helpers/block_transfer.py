"""Move paged KV blocks over a KVTransport: gather into one contiguous buffer, send, scatter.

planes is [P, num_blocks, E]: KVCache.layer_planes(layer) for one layer (layer-wise transfer),
or kv.view(2 * num_layers, num_blocks, -1) for every layer at once. The sender's and the
receiver's block ids differ (each side allocates its own blocks); only their count must match.
On CUDA the gather/scatter run on the current stream, which NCCL's send waits on and its recv
is waited on by, so no extra synchronization is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.ops.block_copy import BlockCopyError, gather_blocks, scatter_blocks
from splitserve.kvtransfer.transport import KVTransport


def send_blocks(
    transport: KVTransport,
    peer_id: str,
    planes: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    tag: int,
    staging: torch.Tensor | None = None,
    timeout_s: float | None = None,
) -> int:
    """Pack planes[:, block_ids] (into staging if given, [P, n, E]) and send it; returns bytes."""
    packed = gather_blocks(planes, block_ids, out=staging)
    return transport.send(peer_id, [packed], tag, timeout_s)


def recv_blocks(
    transport: KVTransport,
    peer_id: str,
    planes: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    tag: int,
    staging: torch.Tensor | None = None,
    timeout_s: float | None = None,
) -> int:
    """Receive n packed blocks and write them to planes[:, block_ids]; returns bytes."""
    shape = (planes.shape[0], len(block_ids), planes.shape[2])
    if staging is None:
        staging = torch.empty(shape, dtype=planes.dtype, device=planes.device)
    elif tuple(staging.shape) != shape or staging.dtype != planes.dtype:
        # Checked before receiving: a wrong buffer would desynchronize the pair.
        raise BlockCopyError(f"staging is {staging.dtype} {tuple(staging.shape)}, expected {planes.dtype} {shape}")
    num_bytes = transport.recv(peer_id, [staging], tag, timeout_s)
    scatter_blocks(staging, planes, block_ids)
    return num_bytes
