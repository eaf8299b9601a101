"""Maps sequences to KV blocks: prefix-cache lookup, slot allocation, caching, freeing.

Pure integers (it owns the device BlockPool and, with num_host_blocks, the HostBlockPool);
the model runner turns block tables into tensors, and a KVBlockMover (set by the engine)
copies blocks between the tiers. With a host tier, a cached block the device pool evicts is
written to host memory first (at eviction, in one copy per allocation), and a prompt whose
prefix continues from the device into the host tier gets those blocks read back into fresh
device blocks while it is admitted, before its chunk runs: a load, not a recompute.

Sliding windows (`window`: set where every layer of the model is windowed, ModelConfig.kv_window):
a query reads only its last `window` positions, so a sequence's leading blocks that no query
from its next position on can see are freed as it advances (after each step), and never
touched or allocated when it is admitted past them (a prefix-cache hit, or a decode replica's
reservation for a prefilled prompt, whose transfer then skips them too). Such a table entry
holds SKIPPED_BLOCK (a valid block id no attention reads: engine/ops/attention.py starts at the
window's first block); seq.num_skipped_blocks counts them. A freed block keeps its hash, like
any freed cached block: it stays in the prefix index, evictable (LRU), because its KV is still
exact for its prefix -- a later request with that prefix reuses it, and the router hears of it
only when the pool evicts it, like any block. Dropping the hash instead would make every prompt
longer than a window uncacheable past its first window, since a hit must start at block 0.
A prefill-only sequence (disaggregated prefill) keeps its blocks until the handoff releases
them: what the decode replica asks for depends on its own configuration, not this one's.
Mixed models (Gemma 3's global layers, Qwen2's layers below max_window_layers) free nothing
early: a block holds every layer's KV for its tokens, and a global layer reads them all. Freeing
only the local layers' share would need a block table per layer kind (vLLM's hybrid allocator).
"""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.engine.core.block_pool import BlockPool
from splitserve.engine.core.host_block_pool import HostBlockPool
from splitserve.engine.core.kv_cache_tier import KVBlockMover
from splitserve.engine.core.kv_event_log import KVEventLog
from splitserve.engine.core.sequence import Sequence
from splitserve.proto.messages.kv_events import KVEvent

# The table entry of a block freed (or never allocated) because no query can see it any more.
SKIPPED_BLOCK = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        window: int | None = None,
    ):
        """window: the tokens every layer's queries see (None: some layer sees the whole
        context, and no block is freed before its sequence ends)."""
        self.block_size = block_size
        self.window = window
        self.events = KVEventLog()
        self.pool = BlockPool(num_blocks, enable_caching, self.events)
        self.host: HostBlockPool | None = None
        self.mover: KVBlockMover | None = None
        if num_host_blocks > 0 and enable_caching:
            self.host = HostBlockPool(num_host_blocks, self.events)
            self.pool.on_evict = self._offload
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0
        self.num_host_hit_tokens = 0  # of num_hit_tokens: read back from the host tier

    def set_mover(self, mover: KVBlockMover) -> None:
        """The torch side that copies KV between the tiers (needed once a host tier exists)."""
        self.mover = mover

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_blocks(self, seq: Sequence, max_tokens: int | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of seq's full blocks.

        At most max_tokens tokens are covered (default: all but the last token, since the
        last token must still be computed to produce logits)."""
        seq.update_block_hashes()
        limit = seq.num_tokens - 1 if max_tokens is None else max_tokens
        hashes = seq.block_hashes[: max(limit, 0) // self.block_size]
        host = self.host
        plan: list[int | None] = []  # per leading block: its device block, or None: in host memory
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None and (host is None or host.lookup(h) is None):
                break
            plan.append(block)
        if host is not None and None in plan:
            return self._load_from_host(plan, hashes)
        return [b for b in plan if b is not None]  # no host tier: the loop stopped at the first None

    # ---- host tier -----------------------------------------------------------------------
    def _offload(self, blocks: list[int], block_hashes: list[int]) -> None:
        """BlockPool.on_evict: copy evicted cached blocks to the host tier before reuse."""
        assert self.host is not None and self.mover is not None  # installed only with a host tier
        indices, slots = self.host.store(block_hashes)
        if indices:
            self.mover.save([blocks[i] for i in indices], slots)

    def _load_from_host(self, plan: list[int | None], hashes: list[int]) -> list[int]:
        """Read the prefix's blocks that only the host tier holds (None in plan) into fresh
        device blocks, enter them into the device prefix cache and return the prefix's blocks
        (unreferenced, like any cached block find_cached_blocks returns). The prefix ends
        where the device pool has no free block left for a load."""
        assert self.host is not None and self.mover is not None  # called only with a host tier
        missing = [i for i, b in enumerate(plan) if b is None]
        num_revived = sum(1 for b in plan if b is not None and self.pool.ref_counts[b] == 0)
        room = max(self.pool.num_free_blocks - num_revived, 0)
        if len(missing) > room:
            plan, missing = plan[: missing[room]], missing[:room]
        if not missing:
            return [b for b in plan if b is not None]  # all on device: nothing is None
        on_device = [b for b in plan if b is not None]
        load_hashes = [hashes[i] for i in missing]
        slots = self.host.pin(load_hashes)
        self.pool.touch(on_device)  # so making room cannot evict the prefix itself
        loaded = False
        try:
            blocks = self.pool.allocate(len(missing))  # may offload other blocks, never the pinned ones
            try:
                self.mover.load(slots, blocks)
                self.pool.cache_blocks(blocks, load_hashes)
                loaded = True
            except BaseException:
                self.pool.free(blocks)
                raise
        except BaseException:
            self.pool.free(on_device)
            raise
        finally:
            self.host.unpin(load_hashes, loaded)
        for i, block in zip(missing, blocks, strict=True):
            plan[i] = block
        prefix = [b for b in plan if b is not None]  # every hole is filled now
        self.pool.free(prefix)  # in prompt order: the prefix's head stays cached longest
        self.num_host_hit_tokens += len(missing) * self.block_size
        return prefix

    def can_allocate(self, num_new_blocks: int, cached_blocks: Iterable[int] = ()) -> bool:
        # Reviving a free cached block takes it out of the free queue too.
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        return num_new_blocks <= self.pool.num_free_blocks - num_revived

    def num_dead_blocks(self, next_query: int) -> int:
        """Leading blocks that no query at position next_query or later sees (0 without a
        window): a query sees its last `window` positions, itself included."""
        if self.window is None:
            return 0
        return max(next_query - self.window + 1, 0) // self.block_size

    def allocate_prompt(
        self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int, next_query: int | None = None
    ) -> bool:
        """First admission (or re-admission after preemption): reuse cached_blocks, allocate
        blocks for num_new_tokens more. next_query: the first position a query will run at
        (default: the first new token; a reservation's prompt, whose KV arrives: its end); the
        blocks no query from there on sees are skipped. Returns False (and changes nothing)
        if out of blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        num_cached = len(cached_blocks) * self.block_size
        num_blocks = _cdiv(num_cached + num_new_tokens, self.block_size)
        dead = min(self.num_dead_blocks(num_cached if next_query is None else next_query), num_blocks)
        live_cached = cached_blocks[dead:]
        num_new_blocks = num_blocks - max(len(cached_blocks), dead)
        if not self.can_allocate(num_new_blocks, live_cached):
            return False
        self.pool.touch(live_cached)
        seq.block_table = [SKIPPED_BLOCK] * dead + live_cached + self.pool.allocate(num_new_blocks)
        seq.num_skipped_blocks = dead
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = max(len(cached_blocks), dead)  # a skipped block is never entered
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

    def cache_computed_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Enter every full, computed block of seq into the prefix cache (emits KV events).
        num_computed: the tokens whose KV is written (default seq.num_computed_tokens; less
        when a step already counted is still running, async scheduling)."""
        num_computed = seq.num_computed_tokens if num_computed is None else num_computed
        num_full = min(num_computed // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        seq.update_block_hashes()
        num_full = min(num_full, len(seq.block_hashes))
        self.pool.cache_blocks(
            seq.block_table[seq.num_registered_blocks : num_full],
            seq.block_hashes[seq.num_registered_blocks : num_full],
        )
        seq.num_registered_blocks = num_full

    def free_dead_blocks(self, seq: Sequence, next_query: int) -> None:
        """Free seq's leading blocks that no query at next_query or later sees (a window's
        sequence has moved past them); they keep their hashes (the module docstring: why)."""
        dead = min(self.num_dead_blocks(next_query), len(seq.block_table))
        skipped = seq.num_skipped_blocks
        if dead <= skipped:
            return
        self.pool.free(seq.block_table[skipped:dead])
        seq.block_table[skipped:dead] = [SKIPPED_BLOCK] * (dead - skipped)
        seq.num_skipped_blocks = dead
        seq.num_registered_blocks = max(seq.num_registered_blocks, dead)

    def free(self, seq: Sequence) -> None:
        held = seq.block_table[seq.num_skipped_blocks :]
        if held:
            self.pool.free(held)
        seq.block_table = []
        seq.num_skipped_blocks = 0
        seq.num_registered_blocks = 0

    # ---- pool views ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def take_events(self) -> list[KVEvent]:
        return self.events.take()

    def snapshot(self) -> tuple[int, list[int]] | tuple[int, list[int], list[int]]:
        """(last event's seq, device hashes), and the host tier's hashes third when it exists."""
        if self.host is None:
            return self.pool.snapshot()
        return self.events.seq, self.pool.cached_hashes(), self.host.cached_hashes()
