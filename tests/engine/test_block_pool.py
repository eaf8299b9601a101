"""Block pool, block hashes and the KV cache manager: pure-integer bookkeeping."""

import pytest

from splitserve.engine.core.block_hash import ROOT_HASH, extend_hashes, hash_block, hash_blocks, root_hash
from splitserve.engine.core.block_pool import BlockPool, NoFreeBlocksError
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.sequence import Sequence
from splitserve.proto.messages.kv_events import REMOVED, STORED, KVEvent
from splitserve.proto.messages.sampling_params import SamplingParams


def test_hash_is_fixed_and_chained():
    # Pinned values: any process (router, other replicas, later versions) must agree.
    assert ROOT_HASH == 0xEE3624707CDD2428
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == 0x033DF3814B7D8B13
    assert hash_blocks([], 4) == []
    h = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(h) == 2
    assert h[0] == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h[1] == hash_block(h[0], [5, 6, 7, 8])
    assert hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != h[1]  # chain carries the prefix
    assert h == hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    chain = []
    extend_hashes(chain, [1, 2, 3, 4, 5], 4)
    extend_hashes(chain, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert chain == h


def test_hash_stable_across_processes():
    import subprocess
    import sys

    code = "from splitserve.engine.core.block_hash import hash_blocks; print(hash_blocks(list(range(32)), 16))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
        cwd=str(__import__("pathlib").Path(__file__).parents[2]),
    )
    assert out.stdout.strip() == str(hash_blocks(list(range(32)), 16))


def test_hash_rejects_bad_tokens():
    with pytest.raises(ValueError):
        hash_block(ROOT_HASH, [-1])


def test_pool_lru_keeps_hash_until_reuse_and_emits_events():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_blocks(a, [111, 222])
    assert pool.take_events() == [KVEvent(1, STORED, (111, 222))]
    pool.free(a)
    assert pool.num_free_blocks == 4
    assert pool.lookup(111) == a[0]  # still cached while free
    pool.touch([a[0]])  # revive
    assert pool.num_free_blocks == 3
    pool.free([a[0]])
    # Uncached blocks are reused before cached ones.
    b = pool.allocate(2)
    assert set(b).isdisjoint(a)
    assert pool.take_events() == []
    c = pool.allocate(1)  # must evict a cached block now: the tail of the freed request first
    assert c == [a[1]]
    assert pool.take_events() == [KVEvent(2, REMOVED, (222,))]
    assert pool.snapshot() == (2, [111])
    pool.free(b + c)
    assert pool.num_free_blocks == 4


def test_pool_errors():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(b)


def test_event_wire_round_trip():
    ev = KVEvent(7, STORED, (1, 2**64 - 1))
    assert KVEvent.from_wire(ev.to_wire()) == ev


def test_kv_manager_prefix_hit_and_baseline():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    p = SamplingParams(max_tokens=4)
    s1 = Sequence("a", list(range(10)), p, 4)
    assert kv.allocate_prompt(s1, kv.find_cached_blocks(s1), 10)
    assert len(s1.block_table) == 3
    s1.num_computed_tokens = 10
    kv.cache_computed_blocks(s1)
    s2 = Sequence("b", list(range(9)) + [99, 98], p, 4)
    cached = kv.find_cached_blocks(s2)
    assert cached == s1.block_table[:2]
    assert kv.allocate_prompt(s2, cached, s2.num_tokens - 8)
    assert s2.num_cached_tokens == 8 and s2.num_computed_tokens == 8
    # A prompt made only of cached full blocks still computes its last token.
    s3 = Sequence("c", list(range(8)), p, 4)
    assert len(kv.find_cached_blocks(s3)) == 1
    for s in (s1, s2):
        kv.free(s)
    assert kv.num_free_blocks == 8


def test_kv_manager_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = Sequence("a", list(range(12)), SamplingParams(), 4)
    assert not kv.allocate_prompt(s, [], 12)
    assert s.block_table == [] and kv.num_free_blocks == 2


def test_a_hash_seed_gives_a_chain_of_its_own_and_sequences_follow_it():
    tokens = list(range(32))
    assert root_hash(None) == root_hash("") == ROOT_HASH  # one model: the unseeded chain, as before
    alpha, beta = (hash_blocks(tokens, 16, root_hash(m)) for m in ("alpha", "beta"))
    assert set(alpha).isdisjoint(beta) and set(alpha).isdisjoint(hash_blocks(tokens, 16))
    seq = Sequence("r", tokens, SamplingParams(max_tokens=1), 16, root_hash=root_hash("alpha"))
    assert seq.update_block_hashes() == alpha


def test_a_lora_adapter_gives_a_chain_of_its_own_under_each_model_seed():
    tokens = list(range(32))
    roots = {(seed, adapter): root_hash(seed, adapter) for seed in (None, "alpha") for adapter in (None, "sql", "fr")}
    assert len(set(roots.values())) == len(roots)  # no two (model, adapter) pairs share a chain
    assert roots[(None, None)] == ROOT_HASH and roots[("alpha", None)] == root_hash("alpha")  # as before
    chains = [set(hash_blocks(tokens, 16, root)) for root in roots.values()]
    assert all(a.isdisjoint(b) for i, a in enumerate(chains) for b in chains[i + 1 :])
