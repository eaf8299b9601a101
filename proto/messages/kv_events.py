"""KV events: what a block pool reports about its prefix cache (pure data, no torch).

A pool numbers its events per pool, consecutively from 1; outside indexes (the router) apply
them in order and resync from a snapshot when they see a gap. An event is a msgspec Struct
encoded as a msgpack array `[seq, kind, [hashes]]` (like vLLM's KV events); it travels inside
a replica's poll reply (splitserve.proto.messages.poll_reply), which carries the version.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

KVEventKind = Literal["stored", "removed"]
STORED: Final = "stored"
REMOVED: Final = "removed"


class KVEvent(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    seq: int  # per-pool sequence number, consecutive from 1
    kind: KVEventKind
    block_hashes: tuple[int, ...]  # chained block hashes (engine/core/block_hash.py), unsigned 64-bit

    def to_wire(self) -> list[Any]:
        """The event as plain data, as it is encoded: `[seq, kind, [hashes]]`."""
        return [self.seq, self.kind, list(self.block_hashes)]

    @classmethod
    def from_wire(cls, raw: Any) -> KVEvent:
        """Check and convert the plain-data form; msgspec.ValidationError (a ValueError) if malformed."""
        return msgspec.convert(raw, cls)
