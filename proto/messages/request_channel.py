"""The request channel: what an ingress and a replica say to each other over the one TCP
connection the ingress keeps to that replica. No Ray call per request, per token, or per poll.

    ingress -> replica  Hello (once), Submit, Abort (decode only), Subscribe, Unsubscribe
    replica -> ingress  Welcome (once), TokenBatch (one per engine step), Failed (decode only),
                        ReplicaState (pushed KV events and load, both pools)

A decode replica takes requests and pushes its state; a prefill replica only pushes its state
(its channel refuses a Submit). ReplicaState frames are numbered per replica (`seq`, one
counter for all of its subscribers): an ingress that sees a jump lost frames (the replica
skips a subscriber that stopped reading) and resyncs from one snapshot; the KV events inside
keep their own per-replica numbers, as in a poll reply.

A frame is a 4-byte big-endian length and one msgspec msgpack message of a tagged union, so
a frame of another kind or a malformed one is refused with a clear ChannelError. The
handshake carries the protocol version and both ends' ids: a version mismatch, or a port
that now belongs to another replica, ends the connection before any request is sent.
Ordering on one stream means an Abort never overtakes its Submit. When the connection
closes, the decode replica aborts every request that came on it, and the ingress fails every
request it had sent there (retryable if nothing streamed yet). Torch-free and Ray-free.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from typing import TypeVar

import msgspec

from splitserve.proto.messages.codec import MessageError
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.sampling_params import SamplingParams

CHANNEL_VERSION = 3  # 2: Subscribe, Unsubscribe, ReplicaState; 3: Submit.sampling is a SamplingParams Struct
MAX_FRAME_BYTES = 64 << 20  # a prompt of a few million tokens; anything bigger is garbage
_HEADER = struct.Struct("!I")
M = TypeVar("M")


class ChannelError(MessageError):
    """A frame that is malformed, too big, of an unexpected kind, or of another version."""


class FailureKind(enum.StrEnum):
    """Why decode gave up on a request; with Failed.retryable, what the ingress does next."""

    PREFILL_FAILED = "prefill_failed"  # the remote prefill or its KV transfer failed: try another prefill replica
    PREFILL_TIMEOUT = "prefill_timeout"  # the prefill replica did not answer in time (hung): try another
    PREFILL_DEAD = "prefill_dead"  # the prefill replica is gone: try another (costs no retry budget)
    BUSY = "busy"  # no KV blocks came free on this decode replica: try another
    REPLICA_DEAD = "replica_dead"  # this decode replica's engine loop stopped for good: try another
    REPLICA_DRAINING = "replica_draining"  # this decode replica is draining: go on from another
    INVALID = "invalid"  # the request itself is bad
    STEP_FAILED = "step_failed"  # an engine step failed with this request in the batch
    INTERNAL = "internal"  # anything else


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    version: int
    ingress_id: str


class Welcome(msgspec.Struct, tag="welcome", forbid_unknown_fields=True):
    version: int
    replica_id: str
    error: str = ""  # set when the replica refuses the connection (then it closes it)


class Submit(msgspec.Struct, tag="submit", forbid_unknown_fields=True):
    """Generate for a prompt tokenized at the ingress. request_id is the ingress's own unique
    id (the only key anywhere); label is the client's id, only logged."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_replica_id: str | None = None  # None: decode prefills locally
    label: str = ""
    deadline: float | None = None  # time.time() after which the request is abandoned
    lease_s: float = 20.0
    layerwise: bool = True
    early_first_token: bool = False  # a remote prefill's first token streams before its KV lands


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    request_id: str


class TokenBatch(msgspec.Struct, tag="tokens", forbid_unknown_fields=True):
    """Everything one engine step produced for the requests of one connection."""

    chunks: list[StreamChunk]


class Failed(msgspec.Struct, tag="failed", forbid_unknown_fields=True):
    request_id: str
    kind: FailureKind
    retryable: bool  # another replica may succeed (the ingress retries only if nothing streamed)
    message: str  # short and client-safe: no traceback, path or pid


class Subscribe(msgspec.Struct, tag="subscribe", forbid_unknown_fields=True):
    """Push this replica's state to me: at once (the KV events after since_seq still in the
    replica's log, and its load), then whenever it changes, at most every push interval, and
    at least every heartbeat. Sent again, it restarts from since_seq."""

    since_seq: int  # the last KV event the ingress's index holds (its snapshot's, at first)
    # False: load and health only, no KV events, one frame every interval_s whether or not
    # anything changed (the controller's subscription: it needs no events, and seconds-scale).
    events: bool = True
    interval_s: float = 0.0


class Unsubscribe(msgspec.Struct, tag="unsubscribe", forbid_unknown_fields=True):
    """Stop pushing state on this connection (requests keep flowing)."""


class ReplicaState(msgspec.Struct, tag="state", forbid_unknown_fields=True):
    """A replica's pushed state: the KV events since its last frame (to this subscriber) and
    its current load and health, in the same PollReply a poll answers."""

    seq: int  # frame number, one counter per replica, +1 per frame it pushes
    reply: PollReply


ToDecode = Hello | Submit | Abort | Subscribe | Unsubscribe
ToIngress = Welcome | TokenBatch | Failed | ReplicaState

_encoder = msgspec.msgpack.Encoder()
_to_decode: msgspec.msgpack.Decoder[ToDecode] = msgspec.msgpack.Decoder(ToDecode)
_to_ingress: msgspec.msgpack.Decoder[ToIngress] = msgspec.msgpack.Decoder(ToIngress)


def encode_frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


def decode_to_decode(body: bytes) -> ToDecode:
    return _decode(_to_decode, body)


def decode_to_ingress(body: bytes) -> ToIngress:
    return _decode(_to_ingress, body)


def _decode(decoder: msgspec.msgpack.Decoder[M], body: bytes) -> M:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ChannelError(f"malformed request-channel frame: {exc}") from None


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's body, or None when the peer closed the connection between frames."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ChannelError("connection closed inside a frame header") from None
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ChannelError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES} byte limit")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ChannelError("connection closed inside a frame") from None


def check_version(version: int, peer: str) -> None:
    if version != CHANNEL_VERSION:
        raise ChannelError(f"{peer} speaks request-channel version {version}; this build speaks {CHANNEL_VERSION}")
