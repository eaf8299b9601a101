"""TensorParallelHostKV: the host KV tier of a tensor-parallel engine, per rank. Each rank holds
only its KV heads, so each keeps its own heads' evicted blocks in its own host memory
(kv_offloading_size GiB per rank; every rank's slots hold the same blocks). The driver's
scheduler (engine/core/host_block_pool.py) alone decides what moves where; each copy goes to
the followers as a header on their pipes -- ordered after the forwards sent before it and
before those sent after, as the driver's own copy is on its device -- and the driver then
copies its own heads.
"""

from __future__ import annotations

from splitserve.engine.ops.host_kv_cache import HostKVCache
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.parallel.tp_ranks import TensorParallelRanks


class TensorParallelHostKV(HostKVCache):
    def __init__(self, kv_cache: KVCache, num_slots: int, ranks: TensorParallelRanks):
        super().__init__(kv_cache, num_slots)
        self.ranks = ranks

    def save(self, device_blocks: list[int], host_slots: list[int]) -> None:
        self.ranks.send_host_copy("save", host_slots, device_blocks)
        super().save(device_blocks, host_slots)

    def load(self, host_slots: list[int], device_blocks: list[int]) -> None:
        self.ranks.send_host_copy("load", host_slots, device_blocks)
        super().load(host_slots, device_blocks)
