"""Decode side of a KV transfer: receive packed blocks and unpack them into the paged cache.

Every layer's receive is posted before the prefill side is asked to send, so concurrent
transfers on one pair can never wait on each other (each has its own tags). Messages follow
splitserve.kvtransfer.wire_layout: when the reserved blocks are one ascending run they land in the cache
directly; otherwise in a staging buffer that complete() scatters, layer by layer as they land.

One rank's receives: from each of this rank's routes from the peer replica (head_map.py): one
whole route from the peer's rank when both hold the same heads, else a slice of this rank's KV
heads from each prefill rank that sends them (head_slices.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.head_map import KVRoute
from splitserve.kvtransfer.head_slices import receive_messages, whole_route
from splitserve.kvtransfer.wire_layout import ascending_run_start
from splitserve.proto.messages.handoff import layer_tag


class PostedReceive:
    """Receives posted for one transfer; complete() waits for them and unpacks the blocks."""

    def __init__(
        self,
        transport,
        kv_cache: KVCache,
        peer_id: str,
        transfer_id: int,
        block_ids: list[int],
        layerwise: bool,
        routes: Sequence[KVRoute] | None = None,
    ):
        """routes: this rank's routes from peer_id (default: one whole route from the peer itself)."""
        self.kv_cache = kv_cache
        self.block_ids = block_ids
        self.layerwise = layerwise
        self.num_bytes = 0
        self._ops = []
        self._start = time.perf_counter()
        if not block_ids:
            return
        routes = [whole_route(peer_id, kv_cache)] if routes is None else routes
        num_layers = kv_cache.num_layers
        ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
        run_start = ascending_run_start(block_ids)
        packed_tag = layer_tag(transfer_id, num_layers, num_layers)
        for layer in range(num_layers):
            # Packed transfers share one tag, but arrive (and are unpacked) layer by layer too.
            tag = layer_tag(transfer_id, layer, num_layers) if layerwise else packed_tag
            for route in routes:
                messages, unpack = receive_messages(kv_cache, layer, route, ids, run_start)
                self._ops.append((unpack, transport.irecv(route.endpoint, messages, tag)))

    def complete(self, timeout_s: float) -> tuple[int, float]:
        """Wait for every layer (in order, unpacking each as it lands). Returns (bytes, seconds).
        Raises TransferError on a dead or stalled peer instead of hanging."""
        deadline = time.monotonic() + timeout_s
        for unpack, op in self._ops:
            self.num_bytes += op.wait(max(deadline - time.monotonic(), 0.001))
            if unpack is not None:
                unpack()
        return self.num_bytes, time.perf_counter() - self._start

    def abandon(self, timeout_s: float) -> None:
        """Wait (bounded) for posted receives to settle so their buffers and blocks can go."""
        deadline = time.monotonic() + timeout_s
        for _, op in self._ops:
            try:
                op.wait(max(deadline - time.monotonic(), 0.001))
            except Exception:
                pass
