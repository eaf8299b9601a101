"""Block pool: reference counts, prefix-cache map and an LRU free queue. Pure integers.

Free blocks keep their hash until the block is handed out again, so a later request with the
same prefix can revive them. Every change to the set of cached hashes is recorded as a KV
event (`stored` / `removed`) with a per-pool sequence number; outside indexes (the router)
drain them with take_events() and resync from snapshot() when they see a gap.
"""

from __future__ import annotations

from collections import OrderedDict

from splitserve.proto.messages.kv_events import REMOVED, STORED, KVEvent, KVEventKind


class NoFreeBlocksError(RuntimeError):
    """Asked for more blocks than the pool has free."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Head = next to reuse. Blocks without a hash go to the head so cached ones live longest.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.event_seq = 0
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: int) -> int | None:
        return self.hash_to_block.get(block_hash) if self.enable_caching else None

    def num_cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        n = 0
        for h in block_hashes:
            if self.lookup(h) is None:
                break
            n += 1
        return n

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks blocks from the LRU head, evicting whatever hash they still hold."""
        if num_blocks > len(self.free_queue):
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {len(self.free_queue)} free")
        blocks = []
        evicted = []
        for _ in range(num_blocks):
            block, _ = self.free_queue.popitem(last=False)
            old = self.block_hashes[block]
            if old is not None:
                self.block_hashes[block] = None
                if self.hash_to_block.get(old) == block:
                    del self.hash_to_block[old]
                    evicted.append(old)
            self.ref_counts[block] = 1
            blocks.append(block)
        if evicted:
            self._emit(REMOVED, evicted)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit), reviving free ones."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference per block. Pass a request's blocks in order; the tail is
        queued first so a prompt's last blocks are evicted before its shared prefix."""
        for block in reversed(blocks):
            count = self.ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"double free of block {block}")
            self.ref_counts[block] = count - 1
            if count == 1:
                self.free_queue[block] = None
                if self.block_hashes[block] is None:
                    self.free_queue.move_to_end(block, last=False)

    def cache_blocks(self, blocks: list[int], block_hashes: list[int]) -> None:
        """Record that blocks now hold the KV whose chained hashes are block_hashes."""
        if not self.enable_caching:
            return
        stored = []
        for block, h in zip(blocks, block_hashes):
            if self.block_hashes[block] is not None:
                continue  # already cached (a prefix hit or an earlier step)
            if h in self.hash_to_block:
                continue  # same content computed twice concurrently: keep the first copy
            self.block_hashes[block] = h
            self.hash_to_block[h] = block
            stored.append(h)
        if stored:
            self._emit(STORED, stored)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their data, just not their hash)."""
        dropped = list(self.hash_to_block)
        self.hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        if dropped:
            self._emit(REMOVED, dropped)

    # ---- events --------------------------------------------------------------------------
    def _emit(self, kind: KVEventKind, hashes: list[int]) -> None:
        self.event_seq += 1
        self._events.append(KVEvent(self.event_seq, kind, tuple(hashes)))

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> tuple[int, list[int]]:
        """(sequence number of the last event, every cached hash) for a full resync."""
        return self.event_seq, list(self.hash_to_block)
