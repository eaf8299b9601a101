"""KVEventLog: the one event sequence of a replica's KV cache tiers (torch-free).

Each tier (the device BlockPool and, with kv_offloading_size, the HostBlockPool) emits into the
same log, so a replica's events are numbered consecutively across tiers and an outside index
(the router) sees one ordered stream per replica; the engine drains it with take().
"""

from __future__ import annotations

from splitserve.proto.messages.kv_events import DEVICE, KVEvent, KVEventKind, Tier


class KVEventLog:
    def __init__(self) -> None:
        self.seq = 0
        self._events: list[KVEvent] = []

    def emit(self, kind: KVEventKind, hashes: list[int], tier: Tier = DEVICE) -> None:
        self.seq += 1
        self._events.append(KVEvent(self.seq, kind, tuple(hashes), tier))

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
