"""PollReply: what a prefill or decode replica answers to the ingress's poll() -- its KV events
since the last poll and its load, and whether it still serves. One message for both pools:
every field is always present.

Versioned msgpack (splitserve.proto.messages.codec); torch-free, so the router side can
read it.
"""

from __future__ import annotations

import enum

import msgspec

from splitserve.proto.messages.codec import MessageCodec
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.kv_events import KVEvent

POLL_VERSION = 4  # 2: status and error; 3: KV events carry their tier, host-tier stats; 4: terminating
_codec = MessageCodec(POLL_VERSION)


class TransferTotals(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """KV moved since the replica started: sent by a prefill replica, received by a decode one."""

    num_blocks: int = 0  # blocks of completed transfers
    num_bytes: int = 0
    seconds: float = 0.0  # time the sender spent on them


class ReplicaStatus(enum.Enum):
    SERVING = "serving"
    # The engine loop stopped for good: the replica released every block and fails every
    # call; the ingress drops it from routing at once.
    LOOP_STOPPED = "loop_stopped"


class PollReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    events: list[KVEvent]  # KV events since the last poll, in order
    engine: EngineStats
    # Prefill: prefilled requests whose blocks stay pinned until decode acks (0 on decode).
    num_pinned: int
    # Decode: requests it holds end to end -- running, waiting or in transfer (0 on prefill,
    # whose requests are all in the engine's running and waiting counts).
    num_active: int
    transfer: TransferTotals
    status: ReplicaStatus = ReplicaStatus.SERVING
    error: str = ""  # why the replica stopped serving ("" while it serves)
    # Its worker process got SIGTERM (runtime/sigterm_drain.py): the controller drains it.
    terminating: bool = False

    @property
    def is_serving(self) -> bool:
        return self.status is ReplicaStatus.SERVING

    @property
    def is_idle(self) -> bool:
        """The replica runs, queues, streams and pins nothing."""
        return not (self.engine.num_running or self.engine.num_waiting or self.num_active or self.num_pinned)

    def to_bytes(self) -> bytes:
        return _codec.encode("poll_reply", self)

    @classmethod
    def from_bytes(cls, data: bytes) -> PollReply:
        return _codec.decode("poll_reply", cls, data)
