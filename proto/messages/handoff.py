"""The prefill -> decode handoff and the decode stream: versioned msgpack messages
(msgspec Structs, splitserve.proto.messages.codec). No pickle crosses here.

Flow (decode-driven): the decode replica reserves blocks for the prompt, works out which of
the prompt's blocks it lacks, and sends a Handoff to the prefill replica; the prefill replica
computes the prompt, streams the listed blocks over torch.distributed, and answers with a
PrefillResult carrying the first token. The decode replica streams StreamChunks to the ingress
(in TokenBatch frames of the request channel, proto/messages/request_channel.py).

A constrained request (sampling.structured_output) is compiled on both sides; prefill
samples the first token under the grammar, and its grammar state crosses as the tokens it
accepted, i.e. that first token, which decode replays into its own matcher.
"""

from __future__ import annotations

from typing import Any

import msgspec

from splitserve.proto.messages.codec import MessageCodec, MessageError
from splitserve.proto.messages.sampling_params import SamplingParams

HANDOFF_VERSION = 2  # 2: sampling is a SamplingParams Struct (was a dict)


class HandoffError(MessageError):
    """A handoff message that is malformed or of an unknown version."""


_codec = MessageCodec(HANDOFF_VERSION, HandoffError)


class Handoff(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_size: int
    source: str  # prefill replica id
    destination: str  # decode replica id
    send_block_indices: list[int]  # indices into the prompt's block list that decode lacks
    transfer_id: int  # unique per (source, destination) pair; picks the tags
    epoch: int = 0  # pair incarnation (bumped when a peer restarts)
    layerwise: bool = True  # send each layer as soon as it is computed
    lease_s: float = 20.0  # how long prefill pins the blocks without an ack
    deadline: float | None = None  # wall-clock time after which nobody should bother
    # Push the first token to the decode replica (DecodeWorker.first_token) as soon as it is
    # sampled, before the KV transfer ends; the answer to the prefill call still follows it.
    early_first_token: bool = False

    def to_bytes(self) -> bytes:
        return _codec.encode("handoff", self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Handoff:
        msg = _codec.decode("handoff", cls, data)
        if not msg.prompt_token_ids or msg.block_size < 1:
            raise HandoffError("handoff has an empty prompt or a bad block size")
        num_blocks = -(-len(msg.prompt_token_ids) // msg.block_size)
        if any(not 0 <= i < num_blocks for i in msg.send_block_indices):
            raise HandoffError("handoff lists a block index outside the prompt")
        return msg


class PrefillResult(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    first_token: int
    first_logprob: float | None
    num_cached_tokens: int  # prompt tokens the prefill replica found in its cache
    num_blocks_sent: int
    num_bytes_sent: int
    prefill_seconds: float
    transfer_seconds: float
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    # With top_logprobs: the first token's most likely (token id, logprob) pairs.
    first_top_logprobs: list[tuple[int, float]] = msgspec.field(default_factory=list)
    queue_seconds: float = 0.0  # how long the prompt waited in the prefill replica's queue
    # With sampling.prompt_logprobs: prompt token i + 1's log-probability given the tokens
    # before it, and (prompt_logprobs > 0) its most likely (token id, logprob) pairs; its rank.
    prompt_logprobs: list[float] = msgspec.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = msgspec.field(default_factory=list)
    prompt_ranks: list[int] = msgspec.field(default_factory=list)

    def to_bytes(self) -> bytes:
        return _codec.encode("prefill_result", self)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefillResult:
        return _codec.decode("prefill_result", cls, data)


def layer_tag(transfer_id: int, layer: int, num_layers: int) -> int:
    """Distinct tag for every (transfer, layer) on a pair, so concurrent transfers never mix."""
    return (transfer_id * (num_layers + 1) + layer) % (2**31 - 1)


class StreamChunk(msgspec.Struct, forbid_unknown_fields=True):
    """Decode replica -> frontend: the tokens and text produced since the last chunk."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[float] = msgspec.field(default_factory=list)
    prefill_replica: str | None = None
    # Per token (with top_logprobs): [(token id, logprob), ...], most likely first.
    top_logprobs: list[list[tuple[int, float]]] = msgspec.field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string, on the last chunk
    queue_seconds: float | None = None  # on the first chunk: time the prompt waited to be scheduled
    # On the first chunk, with sampling.prompt_logprobs: as PrefillResult's.
    prompt_logprobs: list[float] = msgspec.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = msgspec.field(default_factory=list)
    prompt_ranks: list[int] = msgspec.field(default_factory=list)
    # On the first chunk: the first token's stages on the replicas (stage -> seconds, each
    # measured where it ran; cluster/frontend/first_token_stages.py), and the decode replica's
    # time from the request's arrival to sending this chunk, which the ingress subtracts from
    # its round trip to get the relay's share.
    first_token_stages: dict[str, float] = msgspec.field(default_factory=dict)
    replica_seconds: float | None = None

    def to_bytes(self) -> bytes:
        return _codec.encode("stream_chunk", self)

    @classmethod
    def from_bytes(cls, data: bytes) -> StreamChunk:
        return _codec.decode("stream_chunk", cls, data)

    def followed_by(self, later: StreamChunk) -> StreamChunk:
        """This chunk and the request's next one as one chunk: the tokens, text and logprobs
        of both in order, the first's per-request facts, the later one's end state."""
        if later.request_id != self.request_id:
            raise ValueError(f"chunks of two requests: {self.request_id!r} and {later.request_id!r}")
        if self.finished:
            raise ValueError(f"request {self.request_id!r} already finished")
        return msgspec.structs.replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            num_cached_tokens=self.num_cached_tokens,
            logprobs=self.logprobs + later.logprobs,
            prefill_replica=self.prefill_replica if self.prefill_replica is not None else later.prefill_replica,
            top_logprobs=self.top_logprobs + later.top_logprobs,
            queue_seconds=self.queue_seconds if self.queue_seconds is not None else later.queue_seconds,
            prompt_logprobs=self.prompt_logprobs + later.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs + later.prompt_top_logprobs,
            prompt_ranks=self.prompt_ranks + later.prompt_ranks,
            first_token_stages=self.first_token_stages or later.first_token_stages,
            replica_seconds=self.replica_seconds if self.replica_seconds is not None else later.replica_seconds,
        )
