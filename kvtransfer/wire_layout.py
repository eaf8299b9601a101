"""Wire layout of a KV transfer: each layer's planes[:, block_ids] (KVCache.layer_planes) goes
out as one message per plane (K, then V; each [num_blocks, E]), layer after layer. Layer-wise
transfers give each layer its own tag; a packed transfer sends every layer under one tag.

Per-plane framing lets either end skip its copy when its own block ids form one ascending run:
that run is contiguous in every plane of the paged cache, so it is sent from (or received into)
the cache directly. Each end decides for itself; the messages are the same either way. Scattered
ids are packed (gather) or unpacked (scatter) through a [P, num_blocks, E] staging buffer whose
planes are the messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ascending_run_start(block_ids: Sequence[int]) -> int | None:
    """b if block_ids is [b, b + 1, ..., b + n - 1] (n >= 1), else None."""
    if not block_ids:
        return None
    start = block_ids[0]
    for offset, block in enumerate(block_ids):
        if block != start + offset:
            return None
    return start


def plane_messages(planes: torch.Tensor, first_block: int, num_blocks: int) -> list[torch.Tensor]:
    """The contiguous [num_blocks, E] views planes[p, first_block:first_block + num_blocks]."""
    return [planes[plane, first_block : first_block + num_blocks] for plane in range(planes.shape[0])]
