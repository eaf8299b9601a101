"""KVIndex: the router's block-hash index follows KV events (a real BlockPool's too),
flags gaps for a resync, and matches prefixes per replica."""

from __future__ import annotations

import pytest

from splitserve.cluster.routing.index import KVEventError, KVIndex
from splitserve.engine.core.block_hash import hash_blocks
from splitserve.engine.core.block_pool import BlockPool
from splitserve.proto.messages.kv_events import KVEvent

BS = 4  # block size: tiny prompts


def _tokens(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BS)]


# ---- KVIndex ----------------------------------------------------------------------------
def test_index_tracks_stored_and_removed_events():
    index = KVIndex()
    index.add_replica("a")
    assert index.apply_events("a", [KVEvent(1, "stored", (1, 2, 3)), [2, "stored", [4]]])
    assert index.num_blocks("a") == 4
    assert index.holders(2) == {"a"}
    assert index.apply_events("a", [[3, "removed", [2, 4]]])
    assert index.num_blocks("a") == 2
    assert index.holders(2) == set()
    assert index.num_indexed_hashes == 2
    assert index.last_seq("a") == 3


def test_index_follows_a_real_block_pool():
    pool = BlockPool(num_blocks=4)
    index = KVIndex()
    index.add_replica("r", *pool.snapshot())
    hashes = hash_blocks(_tokens(1, 3), BS)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, hashes)
    pool.free(blocks)
    pool.allocate(3)  # evicts cached blocks -> "removed" events
    events = [e.to_wire() for e in pool.take_events()]
    assert [e[1] for e in events] == ["stored", "removed"]
    assert index.apply_events("r", events)
    assert index.num_blocks("r") == 1
    assert index.replica_hashes("r") == set(pool.snapshot()[1])


def test_duplicate_events_are_ignored():
    index = KVIndex()
    index.add_replica("a")
    assert index.apply_events("a", [[1, "stored", [10, 11]], [2, "removed", [11]]])
    # Redelivery of both: must not re-store 11.
    assert index.apply_events("a", [[1, "stored", [10, 11]], [2, "removed", [11]]])
    assert index.holders(11) == set() and index.num_blocks("a") == 1
    assert index.replicas_needing_resync() == []


def test_gap_flags_resync_and_resync_repairs():
    index = KVIndex()
    index.add_replica("a")
    assert index.apply_events("a", [[1, "stored", [1, 2]]])
    assert not index.apply_events("a", [[3, "stored", [9]], [4, "stored", [8]]])
    assert index.replicas_needing_resync() == ["a"]
    assert index.holders(9) == set()
    # Refused until resync, even events that would fit.
    assert not index.apply_events("a", [[2, "stored", [5]]])
    index.resync("a", 4, [1, 5, 9, 8])
    assert index.replicas_needing_resync() == []
    assert index.holders(2) == set() and index.holders(9) == {"a"}
    assert index.num_blocks("a") == 4
    assert index.apply_events("a", [[4, "stored", [77]], [5, "stored", [6]]])
    assert index.holders(77) == set() and index.holders(6) == {"a"}


def test_events_for_unknown_replica_ask_for_resync():
    index = KVIndex()
    assert not index.apply_events("ghost", [[1, "stored", [1]]])
    assert index.replicas_needing_resync() == ["ghost"]
    index.resync("ghost", 1, [1])
    assert index.replicas_needing_resync() == [] and index.holders(1) == {"ghost"}


def test_new_replica_from_snapshot_skips_events_in_it():
    index = KVIndex()
    index.add_replica("b", 5, [1, 2, 3])
    assert index.num_blocks("b") == 3
    assert index.apply_events("b", [[5, "removed", [1]], [6, "stored", [4]]])
    assert index.holders(1) == {"b"} and index.holders(4) == {"b"}
    with pytest.raises(ValueError):
        index.add_replica("b")


def test_remove_replica_drops_its_entries_and_reuses_its_slot():
    index = KVIndex()
    index.add_replica("a", 0, [1, 2])
    index.add_replica("b", 0, [1, 3])
    index.remove_replica("a")
    assert index.holders(1) == {"b"} and index.holders(2) == set()
    assert index.num_indexed_hashes == 2
    index.add_replica("c", 0, [2])  # gets a's old slot; must not inherit a's hashes
    assert index.prefix_match([1, 3]) == {"b": 2}
    assert index.prefix_match([2]) == {"c": 1}
    index.remove_replica("nobody")


def test_malformed_event_raises():
    index = KVIndex()
    index.add_replica("a")
    with pytest.raises(KVEventError):
        index.apply_events("a", [[1, "moved", [1]]])
    with pytest.raises(KVEventError):
        index.apply_events("a", [[1, "stored"]])


def test_prefix_match_counts_leading_blocks_per_replica():
    index = KVIndex()
    index.add_replica("a", 0, [1, 2, 3])
    index.add_replica("b", 0, [1, 2, 4])
    index.add_replica("c", 0, [2, 3])  # no first block: no match at all
    index.add_replica("d", 0, [1, 3])  # holds block 3 but not 2: match stops at 1
    assert index.prefix_match([1, 2, 3]) == {"a": 3, "b": 2, "d": 1}
    assert index.prefix_match([1, 2, 3], replica_ids=["b", "c", "zz"]) == {"b": 2}
    assert index.prefix_match([9, 1]) == {}
    assert index.prefix_match([]) == {}
    assert index.prefix_match([1], replica_ids=[]) == {}
