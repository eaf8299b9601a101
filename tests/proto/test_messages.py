"""The typed control messages (msgspec Structs, versioned msgpack): every message round-trips,
and malformed, foreign or unknown-version input is refused with a clear error, never pickled."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from splitserve.engine.core.block_pool import BlockPool
from splitserve.proto.messages.codec import MessageError
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.handoff import (
    HANDOFF_VERSION,
    Handoff,
    HandoffError,
    PrefillResult,
    StreamChunk,
)
from splitserve.proto.messages.kv_events import REMOVED, STORED, KVEvent
from splitserve.proto.messages.poll_reply import POLL_VERSION, PollReply, ReplicaStatus, TransferTotals
from splitserve.proto.messages.request_channel import ChannelError, Submit, decode_to_decode, encode_frame
from splitserve.proto.messages.sampling_params import SamplingParams

STATS = EngineStats(
    num_free_blocks=60,
    num_blocks=64,
    kv_usage=4 / 64,
    num_running=1,
    num_waiting=2,
    num_waiting_tokens=40,
    num_preemptions=0,
    num_computed_prompt_tokens=100,
    num_prefix_hit_tokens=16,
)


def _messages():
    return [
        Handoff("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0), 4, "p0", "d0", [1], 7, epoch=2, deadline=1e9),
        PrefillResult("r", 42, -0.5, 4, 1, 1024, 0.01, 0.002, extra={"entered_at": 1.5}),
        StreamChunk("r", [5, 6], "ab", True, "length", 2, 0, 2, logprobs=[-0.1, -0.2], prefill_replica="p0"),
        # what top logprobs, a stop token / stop string, queue time and penalties look like on the wire
        PrefillResult(
            "r", 42, -0.5, 4, 1, 1024, 0.01, 0.002, first_top_logprobs=[(42, -0.5), (7, -1.5)], queue_seconds=0.2
        ),
        StreamChunk("r", [5], "a", True, "stop", 2, 0, 1, top_logprobs=[[(5, -0.1), (9, -2.0)]], stop_reason=5),
        StreamChunk("r", [5], "a", True, "stop", 2, 0, 1, stop_reason="END", queue_seconds=0.01),
        # prompt log-probabilities (echo with logprobs), -inf included
        PrefillResult(
            "r",
            42,
            -0.5,
            0,
            1,
            1024,
            0.01,
            0.002,
            prompt_logprobs=[-1.5, float("-inf")],
            prompt_top_logprobs=[[(3, -0.2)], [(4, -0.1)]],
            prompt_ranks=[2, 1],
        ),  # fmt: skip
        StreamChunk("r", [5], "a", False, None, 3, 0, 1, prompt_logprobs=[-1.5, -2.0], prompt_top_logprobs=[[], []]),
        PollReply([KVEvent(1, STORED, (1, 2**64 - 1)), KVEvent(2, REMOVED, (1,))], STATS, 1, 0, TransferTotals()),
    ]


def _envelope(v, kind, body) -> bytes:
    return msgspec.msgpack.encode({"v": v, "kind": kind, "body": body})


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert type(msg).from_bytes(msg.to_bytes()) == msg


def test_poll_reply_events_are_typed_and_the_wire_is_compact():
    poll = PollReply.from_bytes(_messages()[-1].to_bytes())
    assert all(isinstance(e, KVEvent) for e in poll.events)
    assert poll.events[0].block_hashes == (1, 2**64 - 1)
    raw = msgspec.msgpack.decode(poll.to_bytes())
    assert raw["v"] == POLL_VERSION and raw["kind"] == "poll_reply"
    assert raw["body"]["events"][0] == [1, "stored", [1, 2**64 - 1], "device"]  # an event is an array
    # Every field is present for both pools.
    assert set(raw["body"]) == {
        "events",
        "engine",
        "num_pinned",
        "num_active",
        "transfer",
        "status",
        "error",
        "terminating",
    }
    assert raw["body"]["status"] == "serving" and poll.is_serving and raw["body"]["terminating"] is False
    assert not poll.is_idle  # running, waiting and pinned
    idle_stats = msgspec.structs.replace(STATS, num_running=0, num_waiting=0)
    assert PollReply([], idle_stats, 0, 0, TransferTotals()).is_idle
    assert not PollReply([], idle_stats, 0, 1, TransferTotals()).is_idle


def test_a_stopped_replica_says_so_in_its_poll_reply():
    stopped = PollReply([], STATS, 0, 0, TransferTotals(), ReplicaStatus.LOOP_STOPPED, "engine loop of d0 stopped")
    raw = msgspec.msgpack.decode(stopped.to_bytes())
    assert raw["body"]["status"] == "loop_stopped" and raw["body"]["error"] == "engine loop of d0 stopped"
    poll = PollReply.from_bytes(stopped.to_bytes())
    assert poll == stopped and poll.status is ReplicaStatus.LOOP_STOPPED and not poll.is_serving
    body = {**raw["body"], "status": "resting"}
    with pytest.raises(MessageError, match="malformed poll_reply body"):
        PollReply.from_bytes(_envelope(POLL_VERSION, "poll_reply", body))


def test_block_pool_events_survive_the_poll_wire():
    pool = BlockPool(num_blocks=4)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [11, 2**64 - 1])
    pool.free(blocks)
    pool.allocate(4)  # evicts both
    events = pool.take_events()
    poll = PollReply.from_bytes(PollReply(events, STATS, 0, 0, TransferTotals()).to_bytes())
    assert poll.events == events
    assert [KVEvent.from_wire(e.to_wire()) for e in events] == events


@pytest.mark.parametrize("cls", [Handoff, PrefillResult, StreamChunk])
def test_handoff_messages_refuse_bad_input(cls):
    good = next(m for m in _messages() if type(m) is cls)
    kind = msgspec.msgpack.decode(good.to_bytes())["kind"]
    body = msgspec.msgpack.decode(good.to_bytes())["body"]
    with pytest.raises(HandoffError, match=f"version {HANDOFF_VERSION + 1}"):
        cls.from_bytes(_envelope(HANDOFF_VERSION + 1, kind, body))
    with pytest.raises(HandoffError, match=f"expected a {kind} message"):
        cls.from_bytes(_envelope(HANDOFF_VERSION, "something_else", body))
    with pytest.raises(HandoffError, match="unknown field"):
        cls.from_bytes(_envelope(HANDOFF_VERSION, kind, {**body, "surprise": 1}))
    with pytest.raises(HandoffError, match="malformed"):
        cls.from_bytes(_envelope(HANDOFF_VERSION, kind, {**body, "request_id": 5}))
    with pytest.raises(HandoffError, match="not a msgpack"):
        cls.from_bytes(pickle.dumps(good))
    with pytest.raises(HandoffError, match="not a msgpack"):
        cls.from_bytes(b"\xdd\xff\xff\xff\xff")  # an array header claiming 4G items
    assert issubclass(HandoffError, MessageError) and issubclass(MessageError, ValueError)


def test_poll_reply_refuses_bad_input():
    body = msgspec.msgpack.decode(_messages()[-1].to_bytes())["body"]
    with pytest.raises(MessageError, match=f"unsupported poll_reply version {POLL_VERSION + 1}"):
        PollReply.from_bytes(_envelope(POLL_VERSION + 1, "poll_reply", body))
    with pytest.raises(MessageError, match="missing required field `num_active`"):
        PollReply.from_bytes(
            _envelope(POLL_VERSION, "poll_reply", {k: v for k, v in body.items() if k != "num_active"})
        )
    bad_event = {**body, "events": [[1, "moved", [1]]]}
    with pytest.raises(MessageError, match="malformed poll_reply body"):
        PollReply.from_bytes(_envelope(POLL_VERSION, "poll_reply", bad_event))
    with pytest.raises(MessageError, match="expected a poll_reply message"):
        PollReply.from_bytes(_messages()[2].to_bytes())  # a StreamChunk


def test_handoff_checks_its_block_indices():
    handoff = _messages()[0]
    with pytest.raises(HandoffError, match="outside the prompt"):
        Handoff.from_bytes(msgspec.structs.replace(handoff, send_block_indices=[2]).to_bytes())
    with pytest.raises(HandoffError, match="empty prompt"):
        Handoff.from_bytes(msgspec.structs.replace(handoff, prompt_token_ids=[]).to_bytes())


def test_sampling_params_survive_the_request_channel():
    params = SamplingParams(logit_bias={3: -100, 7: 2.5}, repetition_penalty=1.3, min_tokens=2, top_logprobs=4)
    submit = decode_to_decode(encode_frame(Submit("r", [1, 2], params))[4:])
    assert submit.sampling == params


def test_sampling_params_cross_as_a_typed_struct_and_are_checked_when_decoded():
    params = SamplingParams(structured_output={"kind": "regex", "value": "[ab]+"}, stop="x", seed=7)
    assert params.structured_output == GrammarSpec("regex", "[ab]+") and params.stop == ["x"]
    submit = decode_to_decode(encode_frame(Submit("r", [1, 2], params))[4:])
    assert submit.sampling == params and isinstance(submit.sampling.structured_output, GrammarSpec)
    # A peer's frame with a value the constructor refuses is a malformed frame, not a request.
    raw = msgspec.msgpack.encode(
        {"type": "submit", "request_id": "r", "prompt_token_ids": [1], "sampling": {"top_p": 0}}
    )
    with pytest.raises(ChannelError, match="top_p"):
        decode_to_decode(raw)
    unknown = msgspec.msgpack.encode(
        {"type": "submit", "request_id": "r", "prompt_token_ids": [1], "sampling": {"tmperature": 1}}
    )
    with pytest.raises(ChannelError, match="tmperature"):
        decode_to_decode(unknown)


def test_queued_chunks_of_a_request_merge_into_one():
    first = StreamChunk(
        "r",
        [5],
        "a",
        False,
        None,
        4,
        2,
        1,
        logprobs=[-0.1],
        prefill_replica="p0",
        queue_seconds=0.01,
        top_logprobs=[[(5, -0.1), (9, -2.0)]],
    )
    second = StreamChunk(
        "r", [6, 7], "bc", False, None, 4, 0, 3, logprobs=[-0.2, -0.3], top_logprobs=[[(6, -0.2)], [(7, -0.3)]]
    )
    last = StreamChunk("r", [8], "d", True, "stop", 4, 0, 4, logprobs=[-0.4], top_logprobs=[[(8, -0.4)]], stop_reason=8)
    merged = first.followed_by(second).followed_by(last)
    assert merged == StreamChunk(
        "r",
        [5, 6, 7, 8],
        "abcd",
        True,
        "stop",
        4,
        2,
        4,
        logprobs=[-0.1, -0.2, -0.3, -0.4],
        prefill_replica="p0",
        top_logprobs=[[(5, -0.1), (9, -2.0)], [(6, -0.2)], [(7, -0.3)], [(8, -0.4)]],
        stop_reason=8,
        queue_seconds=0.01,
    )
    assert first.token_ids == [5] and second.text == "bc"  # the parts are left as they were
    with pytest.raises(ValueError, match="two requests"):
        first.followed_by(StreamChunk("other", [6], "b", False, None, 4, 0, 2))
    with pytest.raises(ValueError, match="already finished"):
        last.followed_by(second)
