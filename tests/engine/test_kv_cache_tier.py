"""The KV cache tier seam (engine/core/kv_cache_tier.py): the device BlockPool and the host
HostBlockPool as KVCacheTiers, and the manager moving blocks between them (pure integers; a
list-backed KVBlockMover stands in for the tensors and checks every byte lands where it should)."""

import pytest

from splitserve.engine.core.block_pool import BlockPool
from splitserve.engine.core.host_block_pool import HostBlockPool
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.kv_cache_tier import KVBlockMover, KVCacheTier
from splitserve.engine.core.sequence import Sequence
from splitserve.proto.messages.kv_events import HOST, REMOVED, STORED, KVEvent
from splitserve.proto.messages.sampling_params import SamplingParams

BS = 4


class ListMover(KVBlockMover):
    """Device and host 'KV' as lists of block contents (the block's hash when written)."""

    def __init__(self, num_device: int, num_host: int):
        self.device: list = [None] * num_device
        self.host: list = [None] * num_host
        self.saves = self.loads = 0

    def save(self, device_blocks, host_slots):
        self.saves += 1
        for b, s in zip(device_blocks, host_slots, strict=True):
            self.host[s] = self.device[b]

    def load(self, host_slots, device_blocks):
        self.loads += 1
        for s, b in zip(host_slots, device_blocks, strict=True):
            self.device[b] = self.host[s]


def _manager(num_device: int, num_host: int) -> tuple[KVCacheManager, ListMover]:
    kv = KVCacheManager(num_device, BS, num_host_blocks=num_host)
    mover = ListMover(num_device, num_host)
    kv.set_mover(mover)
    return kv, mover


def _run_prompt(kv: KVCacheManager, mover: ListMover, tokens: list[int], rid: str) -> tuple[Sequence, int]:
    """Admit a prompt, 'compute' its uncached blocks (write their hash as content), cache and
    free it, checking every reused block holds the right content. Returns (seq, cached blocks)."""
    seq = Sequence(rid, tokens, SamplingParams(max_tokens=1), BS)
    cached = kv.find_cached_blocks(seq)
    assert kv.allocate_prompt(seq, cached, len(tokens) - len(cached) * BS)
    seq.update_block_hashes()
    for i, block in enumerate(seq.block_table[: len(seq.block_hashes)]):
        if i < len(cached):
            assert mover.device[block] == seq.block_hashes[i], "a reused block holds another prefix's KV"
        else:
            mover.device[block] = seq.block_hashes[i]
    seq.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(seq)
    kv.free(seq)
    return seq, len(cached)


def test_both_pools_are_tiers_sharing_one_event_log():
    assert issubclass(BlockPool, KVCacheTier) and issubclass(HostBlockPool, KVCacheTier)
    with pytest.raises(TypeError):
        KVCacheTier(4, None)  # abstract
    kv, _ = _manager(4, 8)
    assert kv.pool.events is kv.host.events
    assert kv.snapshot() == (0, [], [])
    assert KVCacheManager(4, BS).snapshot() == (0, [])  # no host tier: today's shape


def test_host_pool_lru_hard_bound_and_events():
    host = HostBlockPool(3)
    assert host.store([1, 2]) == ([0, 1], [0, 1])
    assert host.store([2]) == ([], [])  # already there: refreshed, not rewritten
    indices, slots = host.store([3, 4])  # full: evicts 1 (least recent), not 2 (refreshed)
    assert indices == [0, 1] and sorted(host.cached_hashes()) == [2, 3, 4] and host.num_free_blocks == 0
    assert host.take_events() == [
        KVEvent(1, STORED, (1, 2), HOST),
        KVEvent(2, REMOVED, (1,), HOST),
        KVEvent(3, STORED, (3, 4), HOST),
    ]
    assert host.store([5, 6, 7, 8])[0] == [1, 2, 3]  # more than fit: only the most recent ones
    assert sorted(host.cached_hashes()) == [6, 7, 8] and host.num_evicted_blocks == 4
    host.pin([6])
    host.store([9, 10])  # a pinned block is never evicted, even if least recently used
    assert host.lookup(6) is not None and len(host.cached_hashes()) == 3
    assert host.store([11, 12, 13])[0] == [1, 2]  # two unpinned slots: room for the last two only
    host.unpin([6])
    assert host.num_loaded_blocks == 1


def test_event_wire_form_carries_the_tier():
    assert KVEvent(1, STORED, (5,)).to_wire() == [1, STORED, [5], "device"]
    host = KVEvent(2, REMOVED, (5,), HOST)
    assert host.to_wire() == [2, REMOVED, [5], HOST]
    assert KVEvent.from_wire(host.to_wire()) == host
    assert KVEvent.from_wire([1, STORED, [5]]).tier == "device"


def test_evicted_blocks_go_to_host_and_load_back_instead_of_recompute():
    kv, mover = _manager(num_device=4, num_host=16)
    a = list(range(100, 113))  # 3 full blocks + 1 token
    _run_prompt(kv, mover, a, "a")
    _run_prompt(kv, mover, list(range(200, 213)), "b")  # evicts a's blocks to host
    assert kv.host.num_stored_blocks == 3 and mover.saves >= 1
    assert kv.pool.num_cached_prefix_blocks(Sequence("x", a, SamplingParams(), BS).block_hashes) == 0
    seq, num_cached = _run_prompt(kv, mover, a, "a2")  # all three blocks loaded back
    assert num_cached == 3 and kv.num_host_hit_tokens == 12 and kv.host.num_loaded_blocks == 3
    assert seq.num_cached_tokens == 12
    assert kv.pool.num_free_blocks == 4  # back to baseline
    kinds = {(e.kind, e.tier) for e in kv.take_events()}
    assert kinds == {(STORED, "device"), (REMOVED, "device"), (STORED, HOST)}


def test_load_makes_room_without_evicting_its_own_prefix_or_sources():
    # The device holds the prompt's first block, the full host tier the next two; making device
    # room for them stores a block to the host tier, which must evict neither.
    kv, mover = _manager(num_device=4, num_host=4)
    p = list(range(1, 14))
    _run_prompt(kv, mover, p, "p")  # 3 cached device blocks
    _run_prompt(kv, mover, list(range(50, 63)), "q")  # p's blocks -> host
    _, num_cached = _run_prompt(kv, mover, p[:5], "p-head")  # block 0 of p loaded back
    assert num_cached == 1 and kv.host.num_free_blocks == 0
    _, num_cached = _run_prompt(kv, mover, p, "p-again")  # content checked block by block
    assert num_cached == 3 and kv.host.num_evicted_blocks >= 1  # others made room, not these
    assert kv.pool.num_free_blocks == 4 and not kv.host._pinned


def test_a_prefix_interleaving_the_tiers_loads_only_its_host_blocks():
    kv, mover = _manager(num_device=6, num_host=16)
    p = list(range(1, 14))  # blocks P0 P1 P2 (+1 token)
    _run_prompt(kv, mover, p, "p")
    _run_prompt(kv, mover, list(range(300, 321)), "q")  # 6 blocks: every P block to host
    seq = Sequence("p-again", p, SamplingParams(), BS)
    seq.update_block_hashes()
    # Bring P1 alone back to the device (as a later turn's hit might): P0 host, P1 device, P2 host.
    p1_block = kv._load_from_host([None], seq.block_hashes[1:2])[0]
    assert kv.pool.lookup(seq.block_hashes[1]) == p1_block
    loads = mover.loads
    _, num_cached = _run_prompt(kv, mover, p, "p-again")
    assert num_cached == 3 and mover.loads == loads + 1 and kv.pool.num_free_blocks == 6


def test_load_is_bounded_by_free_device_blocks_and_frees_everything():
    kv, mover = _manager(num_device=6, num_host=16)
    p = list(range(1, 22))  # 5 full blocks + 1
    _run_prompt(kv, mover, p, "p")
    _run_prompt(kv, mover, list(range(300, 321)), "q")  # evicts all of p's blocks
    hold = Sequence("hold", list(range(500, 517)), SamplingParams(), BS)
    assert kv.allocate_prompt(hold, [], 17)  # 5 blocks held: 1 free
    seq = Sequence("p2", p, SamplingParams(), BS)
    cached = kv.find_cached_blocks(seq)
    assert len(cached) == 1  # only as many as fit
    kv.free(hold)
    assert kv.pool.num_free_blocks == 6 and not kv.host._pinned


def test_without_host_tier_nothing_is_stored():
    kv = KVCacheManager(4, BS)
    assert kv.host is None and kv.pool.on_evict is None
