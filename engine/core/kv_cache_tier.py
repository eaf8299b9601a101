"""KVCacheTier: one tier of KV block storage, as the prefix cache sees it (pure integers, no torch).

A tier is a fixed number of block slots and a map from chained block hash (engine/core/
block_hash.py) to the slot holding that block's KV, for every layer. Two implementations:
  * BlockPool (engine/core/block_pool.py): the device pool the model reads and writes;
    reference-counted, its free blocks form an LRU that keeps their hashes until reuse.
  * HostBlockPool (engine/core/host_block_pool.py): the host-memory tier
    (kv_offloading_size) that keeps blocks the device pool evicts, LRU, a hard bound.
Every change to a tier's set of cached hashes is a KV event tagged with the tier, numbered in
the replica's one KVEventLog, so the router indexes both tiers of a replica consistently.
Where the KV bytes live is the torch side's business (engine/ops/kv_cache.py, host_kv_cache.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from splitserve.engine.core.kv_event_log import KVEventLog
from splitserve.proto.messages.kv_events import KVEvent, KVEventKind, Tier


class KVCacheTier(ABC):
    tier: Tier  # "device" | "host": the tier named in this tier's KV events

    def __init__(self, num_blocks: int, events: KVEventLog | None):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.events = events if events is not None else KVEventLog()

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Slots that hold nothing anyone needs right now (cached but unreferenced ones count)."""

    @abstractmethod
    def lookup(self, block_hash: int) -> int | None:
        """The slot holding block_hash's KV, or None."""

    @abstractmethod
    def cached_hashes(self) -> list[int]:
        """Every hash this tier holds (a snapshot's contents)."""

    # ---- shared views ------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        n = 0
        for h in block_hashes:
            if self.lookup(h) is None:
                break
            n += 1
        return n

    def _emit(self, kind: KVEventKind, hashes: list[int]) -> None:
        self.events.emit(kind, hashes, self.tier)

    @property
    def event_seq(self) -> int:
        return self.events.seq

    def take_events(self) -> list[KVEvent]:
        """Every event of the replica's log since the last call (all tiers sharing it)."""
        return self.events.take()


class KVBlockMover(ABC):
    """Copies KV bytes between the device tier's blocks and the host tier's slots, for every
    layer (the torch side: engine/ops/host_kv_cache.py). Both calls return once the copy is
    ordered before any later write of the source or read of the destination."""

    @abstractmethod
    def save(self, device_blocks: list[int], host_slots: list[int]) -> None:
        """host[host_slots[i]] = device[device_blocks[i]] (blocks the device pool evicts)."""

    @abstractmethod
    def load(self, host_slots: list[int], device_blocks: list[int]) -> None:
        """device[device_blocks[i]] = host[host_slots[i]] (a prompt's prefix read back)."""
