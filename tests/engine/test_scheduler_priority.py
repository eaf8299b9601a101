"""Priorities in the scheduler (vLLM's `priority`: lower runs first): waiting work is ordered
by (priority, arrival); a higher-priority arrival preempts lower-priority running sequences
when batch slots or KV blocks are short, never equal or higher ones; preempted sequences go
back ahead of their equals; with every priority equal it is FCFS; and in the real engine a
preempted sequence's greedy output is unchanged and the block pool returns to baseline."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.scheduler import Scheduler
from splitserve.engine.core.sequence import Sequence, SequenceStatus
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.scheduler_steps import fake_step

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

pytestmark = pytest.mark.timeout(120)
BS = 4
BATCH, INTERACTIVE = 10, 0


def make(num_blocks=16, max_seqs=8, budget=64):
    kv = KVCacheManager(num_blocks, BS)
    return kv, Scheduler(kv, max_seqs, budget, 256, [0])


def seq(name: str, priority: int, prompt_len: int = 7, max_tokens: int = 50) -> Sequence:
    """A sequence whose prompt shares no block with another name's (no prefix-cache sharing)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)
    start = 1 + 100 * (sum(map(ord, name)) % 50)
    return Sequence(name, list(range(start, start + prompt_len)), params, BS)


def test_waiting_work_runs_by_priority_then_arrival():
    _, sched = make(max_seqs=1)
    for name, priority in (("b1", BATCH), ("i1", INTERACTIVE), ("b2", BATCH), ("i2", INTERACTIVE), ("u", -5)):
        sched.add(seq(name, priority, max_tokens=1))
    assert [s.request_id for s in sched.waiting] == ["u", "i1", "i2", "b1", "b2"]
    order = []
    while sched.has_unfinished():
        order += [s.request_id for s in fake_step(sched).seqs]
    assert order == ["u", "i1", "i2", "b1", "b2"]


def test_equal_priorities_are_fcfs_and_a_preempted_sequence_returns_ahead_of_its_equals():
    _, sched = make(num_blocks=6)
    a, b, c = seq("a", 0), seq("b", 0), seq("c", 0)
    for s in (a, b, c):
        sched.add(s)
    preempted = []
    while not preempted:
        preempted = fake_step(sched).preempted
    assert preempted[-1].request_id == "c"  # the newest
    late = seq("late", 0)
    sched.add(late)
    assert [s.request_id for s in sched.waiting][-1] == "late"
    assert sched.waiting[0] is c


def test_a_higher_priority_arrival_preempts_batch_work_for_a_batch_slot():
    kv, sched = make(max_seqs=2)
    b1, b2 = seq("b1", BATCH), seq("b2", BATCH)
    sched.add(b1)
    sched.add(b2)
    fake_step(sched)
    assert sched.running == [b1, b2]
    urgent = seq("i", INTERACTIVE)
    sched.add(urgent)
    batch = fake_step(sched)
    assert batch.preempted == [b2] and urgent in batch.seqs and b2 not in batch.seqs
    assert b2.status is SequenceStatus.WAITING and b2.num_computed_tokens == 0 and b2.num_preemptions == 1
    assert [s.request_id for s in sched.running] == ["b1", "i"]
    peer = seq("b3", BATCH)  # an equal never preempts
    sched.add(peer)
    assert fake_step(sched).preempted == []
    while sched.has_unfinished():
        fake_step(sched)
    assert kv.num_free_blocks == 16


def test_a_higher_priority_arrival_preempts_batch_work_for_kv_blocks():
    kv, sched = make(num_blocks=8, budget=64)
    hogs = [seq(f"b{i}", BATCH, prompt_len=11, max_tokens=8) for i in range(2)]  # 3 blocks each, up to 5
    for s in hogs:
        sched.add(s)
    fake_step(sched)
    urgent = seq("i", INTERACTIVE, prompt_len=11, max_tokens=8)
    sched.add(urgent)
    batch = fake_step(sched)
    assert urgent in batch.seqs and [s.request_id for s in batch.preempted] == ["b1"]
    assert urgent.status is SequenceStatus.RUNNING
    while sched.has_unfinished():
        fake_step(sched)
    assert kv.num_free_blocks == 8


def test_priority_must_be_a_32_bit_integer():
    with pytest.raises(InvalidRequestError, match="priority must be a 32-bit integer"):
        SamplingParams(priority=2**40)
    with pytest.raises(InvalidRequestError, match="priority"):
        SamplingParams(priority=1.5)


def test_preempted_batch_sequences_keep_their_greedy_output(tiny_model):
    """A real engine with room for two sequences: two batch sequences run, then two interactive
    ones arrive and preempt them; everyone's tokens equal a run with nothing else going on."""
    torch.manual_seed(0)
    greedy = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    prompts = [list(range(5 + 7 * i, 25 + 7 * i)) for i in range(4)]
    alone = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128))
    expected = [alone.generate([p], SamplingParams(**greedy))[0].token_ids for p in prompts]
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128, max_num_seqs=2))
    finals = {}
    with torch.inference_mode():
        for i in (0, 1):
            engine.add_request(
                prompt_token_ids=prompts[i], params=SamplingParams(**greedy, priority=BATCH), request_id=f"b{i}"
            )
        for _ in range(3):  # the batch pair is decoding
            engine.step()
        for i in (2, 3):
            engine.add_request(
                prompt_token_ids=prompts[i], params=SamplingParams(**greedy, priority=INTERACTIVE), request_id=f"i{i}"
            )
        order = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
                    order.append(out.request_id)
    assert engine.scheduler.num_preemptions >= 2
    assert order[:2] == ["i2", "i3"]  # the interactive pair finished first
    assert [finals[k] for k in ("b0", "b1", "i2", "i3")] == expected
    assert engine.scheduler.kv.num_free_blocks == 128
