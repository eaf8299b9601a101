"""KV events: what a replica's KV cache tiers report about their prefix caches (pure data, no torch).

A replica numbers its events consecutively from 1, across its tiers (the device pool and, with
kv_offloading_size, the host pool share one KVEventLog); outside indexes (the router) apply
them in order and resync from a snapshot when they see a gap. An event is a msgspec Struct
encoded as a msgpack array `[seq, kind, [hashes], tier]` (like vLLM's KV events, plus the
tier, as Dynamo's KVBM tags its events with a storage tier); it travels inside a replica's
poll reply (splitserve.proto.messages.poll_reply), which carries the version.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

KVEventKind = Literal["stored", "removed"]
STORED: Final = "stored"
REMOVED: Final = "removed"
Tier = Literal["device", "host"]
DEVICE: Final = "device"
HOST: Final = "host"
TIERS: tuple[str, ...] = (DEVICE, HOST)


class KVEvent(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    seq: int  # per-replica sequence number, consecutive from 1
    kind: KVEventKind
    block_hashes: tuple[int, ...]  # chained block hashes (engine/core/block_hash.py), unsigned 64-bit
    tier: Tier = DEVICE  # which KV cache tier stored or dropped them

    def to_wire(self) -> list[Any]:
        """The event as plain data, as it is encoded: `[seq, kind, [hashes], tier]`. The plain form
        without the tier (`[seq, kind, [hashes]]`) is still read, as a device event."""
        return [self.seq, self.kind, list(self.block_hashes), self.tier]

    @classmethod
    def from_wire(cls, raw: Any) -> KVEvent:
        """Check and convert the plain-data form; msgspec.ValidationError (a ValueError) if malformed."""
        return msgspec.convert(raw, cls)
