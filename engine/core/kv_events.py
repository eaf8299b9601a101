"""KV events: what a replica's KV cache tiers report about their prefix caches (pure data, no torch).

A replica numbers its events consecutively from 1, across its tiers (the device pool and, with
kv_offloading_size, the host pool share one KVEventLog); outside indexes (the router) apply
them in order and resync from a snapshot when they see a gap. An event is a msgspec Struct
encoded as a msgpack array `[seq, kind, [hashes], tier]` (like vLLM's KV events, plus the
tier, as Dynamo's KVBM tags its events with a storage tier); it travels inside a replica's
poll reply (splitserve.kvtransfer.poll_reply), which carries the version.
"""

from __future__ import annotations

from typing import Literal

import msgspec

STORED = "stored"
REMOVED = "removed"
DEVICE = "device"
HOST = "host"
Tier = Literal["device", "host"]
TIERS: tuple[str, ...] = (DEVICE, HOST)


class KVEvent(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    seq: int  # per-replica sequence number, consecutive from 1
    kind: Literal["stored", "removed"]
    block_hashes: tuple[int, ...]  # chained block hashes (engine/core/block_hash.py), unsigned 64-bit
    tier: Tier = DEVICE  # which KV cache tier stored or dropped them

    def to_wire(self) -> list:
        """The event as plain data, as it is encoded: `[seq, kind, [hashes], tier]`. The plain form
        without the tier (`[seq, kind, [hashes]]`) is still read, as a device event."""
        return [self.seq, self.kind, list(self.block_hashes), self.tier]

    @classmethod
    def from_wire(cls, raw) -> KVEvent:
        """Check and convert the plain-data form; msgspec.ValidationError (a ValueError) if malformed."""
        return msgspec.convert(raw, cls)


class KVEventLog:
    """The one event sequence of a replica's tiers: each tier emits into it, the engine drains it."""

    def __init__(self) -> None:
        self.seq = 0
        self._events: list[KVEvent] = []

    def emit(self, kind: str, hashes: list[int], tier: str = DEVICE) -> None:
        self.seq += 1
        self._events.append(KVEvent(self.seq, kind, tuple(hashes), tier))

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
