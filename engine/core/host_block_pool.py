"""HostBlockPool: the host-memory KV cache tier (kv_offloading_size). Pure integers, no torch.

It holds blocks the device pool evicted, by chained hash, in host slots; the torch side
(engine/ops/host_kv_cache.py) holds their bytes. Nothing references a host slot between
engine steps: a block is written when the device pool evicts it and read back (copied into
a fresh device block) when a prompt's prefix continues into it, both inside one step, so
eviction here is a plain LRU over every slot and num_blocks is a hard bound. A block already
here when the device evicts it again (it was loaded back) is only refreshed, not rewritten:
a chained hash names its content.
"""

from __future__ import annotations

from collections import OrderedDict

from splitserve.engine.core.kv_cache_tier import KVCacheTier
from splitserve.engine.core.kv_event_log import KVEventLog
from splitserve.proto.messages.kv_events import HOST, REMOVED, STORED


class HostBlockPool(KVCacheTier):
    tier = HOST

    def __init__(self, num_blocks: int, events: KVEventLog | None = None):
        super().__init__(num_blocks, events)
        self._slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot; head = least recently used
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._pinned: set[int] = set()  # hashes being read back: store() does not evict them
        # Since start: blocks written here, read back into the device pool, dropped for room.
        self.num_stored_blocks = 0
        self.num_loaded_blocks = 0
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_slots)

    def lookup(self, block_hash: int) -> int | None:
        return self._slots.get(block_hash)

    def cached_hashes(self) -> list[int]:
        return list(self._slots)

    def store(self, block_hashes: list[int]) -> tuple[list[int], list[int]]:
        """Make room for blocks the device pool evicts, in the order given (least recently used
        first). Returns (indices into block_hashes whose KV must be copied, the host slot for
        each): hashes already here are refreshed instead. Past num_blocks new blocks only the
        last ones fit, so the earlier ones are not written at all."""
        new: dict[int, int] = {}  # hash -> index, first occurrence
        for i, h in enumerate(block_hashes):
            if h in self._slots:
                self._slots.move_to_end(h)
            elif h not in new:
                new[h] = i
        room = self.num_blocks - len(self._pinned)
        keep = list(new.items())[-room:] if room > 0 else []
        evicted: list[int] = []
        if len(self._free_slots) < len(keep):
            for old in list(self._slots):
                if old in self._pinned:
                    continue
                evicted.append(old)
                self._free_slots.append(self._slots.pop(old))
                if len(self._free_slots) == len(keep):
                    break
        indices, slots = [], []
        for h, i in keep:
            slot = self._free_slots.pop()
            self._slots[h] = slot
            indices.append(i)
            slots.append(slot)
        if evicted:
            self.num_evicted_blocks += len(evicted)
            self._emit(REMOVED, evicted)
        if indices:
            self.num_stored_blocks += len(indices)
            self._emit(STORED, [block_hashes[i] for i in indices])
        return indices, slots

    def pin(self, block_hashes: list[int]) -> list[int]:
        """The slots of block_hashes (all cached here), refreshed as most recently used and kept
        from eviction until unpin: they are being read back (making room in the device pool for
        them may store other blocks here meanwhile). The host copy stays after the read."""
        slots = []
        for h in block_hashes:
            self._slots.move_to_end(h)
            slots.append(self._slots[h])
        self._pinned.update(block_hashes)
        return slots

    def unpin(self, block_hashes: list[int], loaded: bool = True) -> None:
        self._pinned.difference_update(block_hashes)
        if loaded:
            self.num_loaded_blocks += len(block_hashes)
