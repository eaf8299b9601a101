"""The step mailbox (engine/parallel/step_mailbox.py): a CPU group's forwards through shared
memory, in the driver's order with the commands on the pipe; a parked follower is woken; a
forward too large for a buffer goes over the pipe. The driver's and a follower's side over one
mapping and a real pipe in this process, then two real ranks of an engine."""

from __future__ import annotations

import mmap
import threading
import time
from multiprocessing import Pipe

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.parallel import step_mailbox
from splitserve.engine.parallel.shm_collectives import LINE_FIELDS, MAILBOX_FIELDS, ShmCollectives, segment_bytes
from splitserve.engine.parallel.step_broadcast import FORWARD, HOST_KV, STOP, HostCopyHeader
from splitserve.engine.parallel.step_mailbox import WAKE, FollowerInbox, MailboxForward, StepMailbox
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import contiguous_metadata, make_checkpoint

SLOT_BYTES = 4096
PARKED = MAILBOX_FIELDS[2]


@pytest.fixture
def pair():
    """rank 0's mailbox and rank 1's inbox over one mapping, and the pipe between them."""
    segment = mmap.mmap(-1, segment_bytes(2, SLOT_BYTES))
    driver_end, follower_end = Pipe()
    driver = ShmCollectives(segment, 0, 2, 30.0, SLOT_BYTES)
    follower = ShmCollectives(segment, 1, 2, 30.0, SLOT_BYTES)
    yield StepMailbox(driver), FollowerInbox(follower, follower_end), driver_end, follower
    driver_end.close()
    follower_end.close()


def _until_parked(counters, flag: int) -> None:
    deadline = time.monotonic() + 60  # a safety net: it parks ~5 ms after its last command
    while not counters[flag]:
        assert time.monotonic() < deadline, "the follower never parked"
        time.sleep(0.01)


def _batch(context_lens: list[int], query_lens: list[int], first_id: int):
    meta = contiguous_metadata(context_lens, query_lens, 16, 3)
    tokens = sum(query_lens)
    return torch.arange(first_id, first_id + tokens), torch.arange(tokens) * 7, meta


def _assert_forward(taken, batch, rows: list[int] | None) -> None:
    ids, positions, meta = batch
    assert isinstance(taken, MailboxForward) and taken.kind == FORWARD
    assert torch.equal(taken.input_ids, ids) and torch.equal(taken.positions, positions)
    got = taken.meta
    for name in ("slot_mapping", "query_start_loc", "context_lens", "block_tables"):
        assert torch.equal(getattr(got, name), getattr(meta, name)), name
        assert getattr(got, name).dtype == getattr(meta, name).dtype, name
    assert got.query_start_loc_cpu == meta.query_start_loc_cpu and got.context_lens_cpu == meta.context_lens_cpu
    assert (got.max_query_len, got.max_context_len) == (meta.max_query_len, meta.max_context_len)
    assert (taken.logits_rows is None) if rows is None else taken.logits_rows.tolist() == rows


def _send(pipe, mailbox: StepMailbox, header) -> None:
    """As TensorParallelRanks sends a command: tagged, then counted."""
    pipe.send((mailbox.posted, header))
    mailbox.message_sent()


def test_forwards_and_pipe_commands_arrive_in_the_drivers_order(pair):
    mailbox, inbox, pipe, _ = pair
    copy = HostCopyHeader(HOST_KV, "save", [1], [2])
    prefill, decode, another = _batch([5, 9], [5, 9], 100), _batch([6, 10], [1, 1], 200), _batch([7], [1], 300)
    _send(pipe, mailbox, copy)  # before any forward
    assert mailbox.post_forward(*prefill, [4, 13])
    pipe.send(WAKE)  # a nudge is no command
    _send(pipe, mailbox, copy._replace(op="load"))  # between forwards 1 and 2
    assert mailbox.post_forward(*decode, None)
    assert inbox.next() == copy
    _assert_forward(inbox.next(), prefill, [4, 13])
    assert inbox.next().op == "load"
    _assert_forward(inbox.next(), decode, None)
    assert mailbox.post_forward(*another, [0])  # forward 1's buffer again: it was taken
    _assert_forward(inbox.next(), another, [0])
    pipe.send((STOP,))  # the driver's close: untagged, uncounted, found when the follower parks
    assert inbox.next() == (STOP,)


def test_a_parked_follower_is_woken_by_the_next_forward(pair):
    mailbox, inbox, pipe, follower = pair
    taken: list = []
    thread = threading.Thread(target=lambda: taken.append(inbox.next()), daemon=True)
    thread.start()
    flag = follower.rank * LINE_FIELDS + PARKED
    _until_parked(follower.counters, flag)  # it polls for a few ms, then parks on its pipe
    batch = _batch([3], [3], 1)
    assert mailbox.post_forward(*batch, [2])
    assert mailbox.parked() == [1]  # the driver sees the flag: it sends a WAKE
    pipe.send(WAKE)
    thread.join(60)
    assert not thread.is_alive()
    _assert_forward(taken[0], batch, [2])
    assert not follower.counters[flag]


def test_a_forward_too_large_for_a_buffer_is_not_posted(pair, monkeypatch):
    mailbox, *_ = pair
    monkeypatch.setattr(step_mailbox, "MAILBOX_BYTES", 256)
    assert not mailbox.post_forward(*_batch([19], [19], 0), [18])
    assert mailbox.posted == 0
    assert mailbox.post_forward(*_batch([20], [1], 0), [0])


PROMPT = [5, 17, 33, 2, 9, 41, 77, 100, 3, 8, 12, 60, 61, 62, 63, 64, 65, 66, 67]


@pytest.mark.parametrize("mailbox_bytes", [None, 512])  # 512: the prefill over the pipe, decode steps posted
def test_two_ranks_generate_what_one_does(models_root, monkeypatch, mailbox_bytes):
    """Greedy tokens of a TP-2 engine whose forwards go through the mailbox equal TP 1's, also
    with the prefill over the pipe and after the follower parked between requests."""
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    if mailbox_bytes is not None:
        monkeypatch.setattr(step_mailbox, "MAILBOX_BYTES", mailbox_bytes)  # the driver's check only
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [PROMPT, PROMPT[3:]]
    reference = LLMEngine(EngineConfig(model=model, num_kv_blocks=64))
    try:
        expected = [r.token_ids for r in reference.generate(prompts, params)]
    finally:
        reference.close()
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=2))
    try:
        ranks, shm = engine.tensor_parallel, engine.tensor_parallel.group.shm
        posted, woken = [], []
        post, write = ranks._post, ranks._write
        monkeypatch.setattr(ranks, "_post", lambda *args: posted.append(post(*args)) or posted[-1])
        monkeypatch.setattr(ranks, "_write", lambda r, c, m: (woken.append(r) if m == WAKE else None, write(r, c, m)))
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected
        assert posted.count(True) >= 7 and posted.count(False) == (0 if mailbox_bytes is None else 1)
        _until_parked(shm.counters, LINE_FIELDS + PARKED)  # rank 1's flag
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected
        if mailbox_bytes is None:  # else the prefill's pipe message wakes it
            assert woken  # the first forward found it parked
    finally:
        engine.close()
