"""KVIndex: which replica holds which chained KV block hash, fed by BlockPool KV events.

Layout (chosen for speed, see bench/control_plane/router_microbench.py):
  * every replica gets a slot number; the global index maps block hash -> int bitmask of
    the slots holding it, so one prompt walk intersects candidate sets with a single `&`
    per block instead of building Python sets;
  * per replica: the set of hashes it holds (for num_blocks, removal and resync) and the
    sequence number of the last applied event.

Tiers: a replica with a host KV tier (kv_offloading_size) also reports the blocks it keeps in
host memory (events tagged `host`). They are indexed apart, in a second hash -> bitmask map and
per-replica set, and tiered_prefix_match() counts, per replica, the leading blocks on its
device and how far the prefix continues through either tier (the rest loads, not recomputes).

Consistency: events must arrive with consecutive seq numbers per replica. Duplicates
(seq <= last applied) are ignored; a gap marks the replica `needs_resync` and further events
are refused until resync() replaces its entries from a BlockPool.snapshot(). Stale entries
of a replica awaiting resync stay in the index: a wrong guess only costs a cache miss.
Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from splitserve.proto.messages.kv_events import DEVICE, HOST, REMOVED, STORED, KVEvent

ReplicaId = Hashable


class KVEventError(ValueError):
    """A KV event that is malformed (unknown kind, bad shape)."""


class _ReplicaEntry:
    __slots__ = ("slot", "bit", "hashes", "host_hashes", "last_seq", "needs_resync")

    def __init__(self, slot: int, last_seq: int):
        self.slot = slot
        self.bit = 1 << slot
        self.hashes: set[int] = set()
        self.host_hashes: set[int] = set()
        self.last_seq = last_seq
        self.needs_resync = False


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # block hash -> bitmask of slots (device tier)
        self._host_holders: dict[int, int] = {}  # the same for the host tier
        self._replicas: dict[ReplicaId, _ReplicaEntry] = {}
        self._slot_owner: list[ReplicaId | None] = []  # slot -> replica id
        self._free_slots: list[int] = []
        # Replicas we got events for before add_replica(): they need a snapshot.
        self._unknown_needing_resync: set[ReplicaId] = set()

    # ---- membership ----------------------------------------------------------------------
    def add_replica(
        self, replica_id: ReplicaId, snapshot_seq: int = 0, hashes: Iterable[int] = (), host_hashes: Iterable[int] = ()
    ) -> None:
        """Start indexing a replica from its engine's snapshot() (host_hashes: its host tier's)."""
        if replica_id in self._replicas:
            raise ValueError(f"replica {replica_id!r} is already indexed; use resync()")
        if snapshot_seq < 0:
            raise ValueError("snapshot_seq must be >= 0")
        slot = self._free_slots.pop() if self._free_slots else len(self._slot_owner)
        if slot == len(self._slot_owner):
            self._slot_owner.append(replica_id)
        else:
            self._slot_owner[slot] = replica_id
        entry = _ReplicaEntry(slot, snapshot_seq)
        self._replicas[replica_id] = entry
        self._unknown_needing_resync.discard(replica_id)
        self._store(entry, hashes if isinstance(hashes, (list, tuple, set)) else list(hashes))
        self._store(entry, list(host_hashes), HOST)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        """Drop every entry of a dead or drained replica. Unknown ids are ignored."""
        self._unknown_needing_resync.discard(replica_id)
        entry = self._replicas.pop(replica_id, None)
        if entry is None:
            return
        self._remove(entry, entry.hashes)
        self._remove(entry, entry.host_hashes, HOST)
        self._slot_owner[entry.slot] = None
        self._free_slots.append(entry.slot)

    def resync(
        self, replica_id: ReplicaId, snapshot_seq: int, hashes: Iterable[int], host_hashes: Iterable[int] = ()
    ) -> None:
        """Replace a replica's entries with a fresh snapshot (adds it if unknown)."""
        if replica_id not in self._replicas:
            self.add_replica(replica_id, snapshot_seq, hashes, host_hashes)
            return
        if snapshot_seq < 0:
            raise ValueError("snapshot_seq must be >= 0")
        entry = self._replicas[replica_id]
        new = set(hashes)
        self._remove(entry, entry.hashes - new)
        self._store(entry, new - entry.hashes)
        new_host = set(host_hashes)
        self._remove(entry, entry.host_hashes - new_host, HOST)
        self._store(entry, new_host - entry.host_hashes, HOST)
        entry.last_seq = snapshot_seq
        entry.needs_resync = False

    # ---- events --------------------------------------------------------------------------
    def apply_events(self, replica_id: ReplicaId, events: Sequence[KVEvent | list[Any]]) -> bool:
        """Apply a replica's events in order (KVEvent, or its plain form `[seq, kind, [hashes]]`).

        Returns False (and flags the replica for resync) on a seq gap or an unknown replica;
        events after the gap are not applied. Raises KVEventError on a malformed event.
        """
        entry = self._replicas.get(replica_id)
        if entry is None:
            if events:
                self._unknown_needing_resync.add(replica_id)
                return False
            return True
        if entry.needs_resync:
            return False
        for event in events:
            if not isinstance(event, KVEvent):
                try:
                    event = KVEvent.from_wire(event)
                except ValueError as exc:
                    raise KVEventError(f"bad KV event {event!r}: want [seq, kind, hashes, tier] ({exc})") from None
            seq, kind, hashes, tier = event.seq, event.kind, event.block_hashes, event.tier
            if seq <= entry.last_seq:
                continue  # duplicate delivery
            if seq != entry.last_seq + 1:
                entry.needs_resync = True
                return False
            if kind == STORED:
                self._store(entry, hashes, tier)
            elif kind == REMOVED:
                self._remove(entry, hashes, tier)
            else:
                raise KVEventError(f"unknown KV event kind {kind!r}")
            entry.last_seq = seq
        return True

    # hashes must be re-iterable (list, tuple, set): they are walked twice.
    def _store(self, entry: _ReplicaEntry, hashes: Iterable[int], tier: str = DEVICE) -> None:
        bit = entry.bit
        holders = self._holders if tier == DEVICE else self._host_holders
        get = holders.get
        for h in hashes:
            holders[h] = get(h, 0) | bit
        (entry.hashes if tier == DEVICE else entry.host_hashes).update(hashes)

    def _remove(self, entry: _ReplicaEntry, hashes: Iterable[int], tier: str = DEVICE) -> None:
        keep = ~entry.bit
        holders = self._holders if tier == DEVICE else self._host_holders
        get = holders.get
        for h in hashes:
            mask = get(h)
            if mask is None:
                continue
            mask &= keep
            if mask:
                holders[h] = mask
            else:
                del holders[h]
        (entry.hashes if tier == DEVICE else entry.host_hashes).difference_update(hashes)

    # ---- queries -------------------------------------------------------------------------
    def prefix_match(
        self, block_hashes: Sequence[int], replica_ids: Iterable[ReplicaId] | None = None
    ) -> dict[ReplicaId, int]:
        """Number of leading blocks of block_hashes each replica holds.

        Only replicas with at least one matched block appear (use .get(id, 0)). replica_ids
        restricts the candidates (unknown ids are ignored). One walk over the hashes; stops
        as soon as no candidate holds the next block.
        """
        return self._match(block_hashes, replica_ids, self._holders.get)

    def tiered_prefix_match(
        self, block_hashes: Sequence[int], replica_ids: Iterable[ReplicaId] | None = None
    ) -> tuple[dict[ReplicaId, int], dict[ReplicaId, int]]:
        """(device, either): per replica, the leading blocks its device holds, and the leading
        blocks it holds in either tier (>= device; the difference loads from host memory).
        Without host-tier entries, a single walk and `either` is `device`."""
        device = self._match(block_hashes, replica_ids, self._holders.get)
        if not self._host_holders:
            return device, device
        dev_get, host_get = self._holders.get, self._host_holders.get
        either = self._match(block_hashes, replica_ids, lambda h, d: dev_get(h, d) | host_get(h, d))
        return device, either

    def _match(
        self,
        block_hashes: Sequence[int],
        replica_ids: Iterable[ReplicaId] | None,
        get: Callable[[int, int], int],
    ) -> dict[ReplicaId, int]:
        if replica_ids is None:
            candidates = -1  # all bits
        else:
            candidates = 0
            replicas = self._replicas
            for rid in replica_ids:
                entry = replicas.get(rid)
                if entry is not None:
                    candidates |= entry.bit
            if not candidates:
                return {}
        result: dict[ReplicaId, int] = {}
        owners = self._slot_owner
        num_matched = 0
        for h in block_hashes:
            alive = get(h, 0) & candidates
            if alive != candidates:
                if num_matched:
                    self._record(result, candidates & ~alive, num_matched, owners)
                if not alive:
                    return result
                candidates = alive
            num_matched += 1
        if num_matched and candidates:
            self._record(result, candidates, num_matched, owners)
        return result

    @staticmethod
    def _record(result: dict[ReplicaId, int], mask: int, num_matched: int, owners: list[ReplicaId | None]) -> None:
        while mask:
            low = mask & -mask
            result[owners[low.bit_length() - 1]] = num_matched
            mask ^= low

    def num_blocks(self, replica_id: ReplicaId, tier: str = DEVICE) -> int:
        entry = self._replicas.get(replica_id)
        if entry is None:
            return 0
        return len(entry.hashes if tier == DEVICE else entry.host_hashes)

    def replica_hashes(self, replica_id: ReplicaId) -> frozenset[int]:
        """Every hash the index believes replica_id holds."""
        entry = self._replicas.get(replica_id)
        return frozenset(entry.hashes) if entry is not None else frozenset()

    def holders(self, block_hash: int) -> set[ReplicaId]:
        """Replica ids that hold block_hash."""
        mask = self._holders.get(block_hash, 0)
        found: set[ReplicaId] = set()
        while mask:
            low = mask & -mask
            found.add(self._slot_owner[low.bit_length() - 1])
            mask ^= low
        return found

    def last_seq(self, replica_id: ReplicaId) -> int:
        entry = self._replicas.get(replica_id)
        if entry is None:
            raise KeyError(replica_id)
        return entry.last_seq

    def replicas_needing_resync(self) -> list[ReplicaId]:
        flagged = [rid for rid, entry in self._replicas.items() if entry.needs_resync]
        return flagged + list(self._unknown_needing_resync)

    def replica_ids(self) -> list[ReplicaId]:
        return list(self._replicas)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    @property
    def num_indexed_hashes(self) -> int:
        """Distinct block hashes held by at least one replica's device tier."""
        return len(self._holders)

    @property
    def num_indexed_host_hashes(self) -> int:
        """Distinct block hashes held by at least one replica's host tier."""
        return len(self._host_holders)
