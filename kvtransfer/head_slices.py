"""The messages of one KV route (head_map.py's KVRoute) for one layer of a transfer.

A whole route (both ranks hold the same heads) moves blocks as stored: wire_layout.py's one
message per plane, [num_blocks, E], straight from/to the cache when the block ids form one run.
A sliced route moves only its heads: per plane (K, V) and per segment of a block -- the values
[block_size, kv_heads, head_dim], and for an 8-bit cache also their scales [block_size, kv_heads]
(as bytes) -- one message [num_blocks, block_size, num_heads, width] of the route's heads,
gathered on the sender and scattered into the receiver's own head positions. Both ends build
the same shapes from the same route, so each message matches its peer's byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.engine.ops.block_copy import gather_blocks, scatter_blocks
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.head_map import KVRoute
from splitserve.kvtransfer.wire_layout import plane_messages


def whole_route(peer_id: str, kv_cache: KVCache) -> KVRoute:
    """The one route of a pair whose two ranks hold the same heads (both TP 1, or equal sizes)."""
    return KVRoute(peer_id, 0, 0, kv_cache.num_kv_heads, True)


def _segments(kv_cache: KVCache, layer: int) -> list[torch.Tensor]:
    """Each plane's segments as [num_blocks, block_size, kv_heads, width] views, plane-major."""
    planes = kv_cache.layer_planes(layer)
    shape = (kv_cache.num_blocks, kv_cache.block_size, kv_cache.num_kv_heads, -1)
    if not kv_cache.quantized:
        return [planes[p].view(shape) for p in range(planes.shape[0])]
    value_bytes = kv_cache.block_size * kv_cache.num_kv_heads * kv_cache.head_dim  # 8-bit values
    return [
        part.view(shape)
        for p in range(planes.shape[0])
        for part in (planes[p][:, :value_bytes], planes[p][:, value_bytes:])
    ]


def _heads(segment: torch.Tensor, route: KVRoute) -> torch.Tensor:
    return segment[:, :, route.head_start : route.head_start + route.num_heads]


def send_messages(
    kv_cache: KVCache, layer: int, route: KVRoute, ids: torch.Tensor, run_start: int | None
) -> list[torch.Tensor]:
    """The layer's messages for route, of blocks ids (run_start: their first id if they are
    one ascending run)."""
    planes = kv_cache.layer_planes(layer)
    if route.whole:
        if run_start is not None:  # pinned until decode acks: straight from the cache
            return plane_messages(planes, run_start, int(ids.shape[0]))
        return list(gather_blocks(planes, ids).unbind(0))
    return [_heads(segment, route).index_select(0, ids) for segment in _segments(kv_cache, layer)]


def filler_messages(kv_cache: KVCache, route: KVRoute, num_blocks: int) -> list[torch.Tensor]:
    """Zeros shaped as one layer's messages for route (an aborted job's unsent layers)."""
    return list(_staging(kv_cache, 0, route, num_blocks, torch.zeros))


def _staging(kv_cache: KVCache, layer: int, route: KVRoute, num_blocks: int, alloc=torch.empty):
    """Buffers for one layer's messages of route: a whole route's [P, num_blocks, E] tensor
    (its planes are the messages), a sliced route's list of [num_blocks, bs, heads, width]."""
    if route.whole:
        planes = kv_cache.layer_planes(layer)
        return alloc(planes.shape[0], num_blocks, planes.shape[2], dtype=planes.dtype, device=planes.device)
    return [
        alloc(num_blocks, *_heads(segment, route).shape[1:], dtype=segment.dtype, device=segment.device)
        for segment in _segments(kv_cache, layer)
    ]


def receive_messages(
    kv_cache: KVCache, layer: int, route: KVRoute, ids: torch.Tensor, run_start: int | None
) -> tuple[list[torch.Tensor], Callable[[], object] | None]:
    """(the buffers to receive the layer's messages of route into, what lands them in the
    cache once received -- None when they are the cache itself)."""
    num_blocks = int(ids.shape[0])
    if route.whole:
        planes = kv_cache.layer_planes(layer)
        if run_start is not None:  # straight into the cache: nothing to unpack
            return plane_messages(planes, run_start, num_blocks), None
        staging = _staging(kv_cache, layer, route, num_blocks)
        return list(staging.unbind(0)), lambda: scatter_blocks(staging, planes, ids)
    segments = _segments(kv_cache, layer)
    buffers = _staging(kv_cache, layer, route, num_blocks)

    def unpack() -> None:
        for segment, buffer in zip(segments, buffers):
            _heads(segment, route).index_copy_(0, ids, buffer)

    return buffers, unpack
