"""Maps sequences to KV blocks: prefix-cache lookup, slot allocation, caching, freeing.

Pure integers (it owns the BlockPool); the model runner turns block tables into tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.engine.core.block_pool import BlockPool
from splitserve.engine.core.sequence import Sequence
from splitserve.proto.messages.kv_events import KVEvent


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_blocks(self, seq: Sequence, max_tokens: int | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of seq's full blocks.

        At most max_tokens tokens are covered (default: all but the last token, since the
        last token must still be computed to produce logits)."""
        seq.update_block_hashes()
        limit = seq.num_tokens - 1 if max_tokens is None else max_tokens
        blocks: list[int] = []
        for h in seq.block_hashes[: max(limit, 0) // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_new_blocks_needed(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> int:
        num_computed = max(seq.num_computed_tokens, len(cached_blocks) * self.block_size)
        return max(
            _cdiv(num_computed + num_new_tokens, self.block_size) - max(len(seq.block_table), len(cached_blocks)), 0
        )

    def can_allocate(self, num_new_blocks: int, cached_blocks: Iterable[int] = ()) -> bool:
        # Reviving a free cached block takes it out of the free queue too.
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        return num_new_blocks <= self.pool.num_free_blocks - num_revived

    def allocate_prompt(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """First admission (or re-admission after preemption): reuse cached_blocks, allocate
        blocks for num_new_tokens more. Returns False (and changes nothing) if out of blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        num_cached = len(cached_blocks) * self.block_size
        num_new_blocks = _cdiv(num_cached + num_new_tokens, self.block_size) - len(cached_blocks)
        if not self.can_allocate(num_new_blocks, cached_blocks):
            return False
        self.pool.touch(cached_blocks)
        seq.block_table = list(cached_blocks) + self.pool.allocate(num_new_blocks)
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = len(cached_blocks)
        if not seq.first_admitted:
            seq.first_admitted = True
            seq.num_cached_tokens = num_cached
            self.num_lookup_tokens += seq.num_prompt_tokens
            self.num_hit_tokens += num_cached
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to cover num_new_tokens more tokens."""
        need = _cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def trim_slots(self, seq: Sequence) -> None:
        """Give back the blocks past the ones seq's tokens occupy (slots reserved for draft
        tokens that were rejected). They hold no accepted KV and were never cached."""
        keep = max(_cdiv(seq.num_tokens, self.block_size), seq.num_registered_blocks)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Enter every full, computed block of seq into the prefix cache (emits KV events)."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        seq.update_block_hashes()
        num_full = min(num_full, len(seq.block_hashes))
        self.pool.cache_blocks(
            seq.block_table[seq.num_registered_blocks : num_full],
            seq.block_hashes[seq.num_registered_blocks : num_full],
        )
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    # ---- pool views ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def snapshot(self) -> tuple[int, list[int]]:
        return self.pool.snapshot()
