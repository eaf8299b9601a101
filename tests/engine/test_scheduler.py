"""Scheduler behaviour without a model: budgets, chunking, preemption, stops, block baseline."""

from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.scheduler import Scheduler
from splitserve.engine.core.sequence import Sequence, SequenceStatus
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.scheduler_steps import FAKE_TOKEN, fake_step

BS = 4


def make(num_blocks=16, max_seqs=8, budget=16, max_len=256, eos=(0,)):
    kv = KVCacheManager(num_blocks, BS)
    return kv, Scheduler(kv, max_seqs, budget, max_len, list(eos))


def test_chunked_prefill_respects_budget_and_decodes_first():
    kv, sched = make(budget=8)
    a = Sequence("a", list(range(1, 21)), SamplingParams(max_tokens=3, ignore_eos=True), BS)
    sched.add(a)
    b1 = fake_step(sched)
    assert b1.num_new_tokens == [8] and a.num_output_tokens == 0
    fake_step(sched)
    fake_step(sched)
    assert a.num_computed_tokens == 20 and a.num_output_tokens == 1
    b = Sequence("b", list(range(1, 30)), SamplingParams(max_tokens=2, ignore_eos=True), BS)
    sched.add(b)
    step = fake_step(sched)
    assert step.seqs[0] is a and step.num_new_tokens[0] == 1  # decode runs before new prefill
    assert step.num_tokens == 8
    while sched.has_unfinished():
        fake_step(sched)
    assert a.finish_reason == "length" and a.num_output_tokens == 3
    assert kv.num_free_blocks == 16


def test_max_num_seqs():
    kv, sched = make(max_seqs=2, budget=64)
    for i in range(3):
        sched.add(Sequence(str(i), [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), BS))
    batch = sched.schedule()
    assert len(batch.seqs) == 2


def test_preemption_by_recompute_and_pool_baseline():
    kv, sched = make(num_blocks=6, budget=64)
    seqs = [
        Sequence(str(i), list(range(1 + i, 8 + i)), SamplingParams(max_tokens=12, ignore_eos=True), BS)
        for i in range(3)
    ]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        fake_step(sched)
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 12 and s.finish_reason == "length" for s in seqs)
    assert kv.num_free_blocks == 6


def test_stop_conditions_and_abort():
    kv, sched = make(eos=(FAKE_TOKEN,))
    s = Sequence("e", [1, 2, 3], SamplingParams(max_tokens=10), BS)
    sched.add(s)
    fake_step(sched)
    assert s.status is SequenceStatus.FINISHED and s.finish_reason == "stop"
    t = Sequence("t", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[FAKE_TOKEN]), BS)
    sched.add(t)
    fake_step(sched)
    assert t.finish_reason == "stop"
    u = Sequence("u", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), BS)
    sched.add(u)
    fake_step(sched)
    sched.abort("u")
    assert u.finish_reason == "abort" and not sched.has_unfinished()
    assert kv.num_free_blocks == 16


def test_prefill_only_holds_blocks_until_released():
    kv, sched = make()
    s = Sequence("p", list(range(1, 10)), SamplingParams(max_tokens=5), BS, prefill_only=True)
    sched.add(s)
    fake_step(sched)
    assert s.status is SequenceStatus.PREFILLED and s.num_output_tokens == 1
    assert not sched.has_unfinished() and kv.num_free_blocks == 16 - 3
    assert len(kv.pool.hash_to_block) == 2  # its two full blocks are in the prefix cache
    sched.release_prefilled(s)
    assert kv.num_free_blocks == 16


def test_sampler_survives_degenerate_parameters():
    import torch

    from splitserve.engine.sample.sampler import Sampler

    def seqs(rids, params):
        return [Sequence(rid, [1, 2], p, 16) for rid, p in zip(rids, params)]

    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=5e-324, top_p=5e-324),  # effectively greedy
        SamplingParams(temperature=100.0, top_p=5e-324, seed=1),  # keeps one token
        SamplingParams(temperature=1.0, top_k=3, seed=2),
    ]
    out = Sampler().sample(logits, seqs(["a", "b", "c"], params))
    assert out[0][0] == int(torch.argmax(logits[0]))
    assert out[1][0] == int(torch.argmax(logits[1]))
    assert out[2][0] in torch.topk(logits[2], 3).indices.tolist()
    inf_row = torch.full((1, 50), float("inf"))
    assert 0 <= Sampler().sample(inf_row, seqs(["d"], [SamplingParams(temperature=1.0)]))[0][0] < 50


def _decoding(sched, rid: str, prompt_len: int, max_tokens: int = 50) -> Sequence:
    first = 100 * (ord(rid) - ord("a") + 1)  # distinct prompts: no shared prefix blocks
    seq = Sequence(
        rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), BS
    )
    sched.add(seq)
    while seq.num_output_tokens == 0:
        fake_step(sched)
    return seq


def test_lookahead_takes_only_what_is_left_and_never_preempts():
    kv, sched = make(num_blocks=7, budget=16)
    a = _decoding(sched, "a", 7)
    b = _decoding(sched, "b", 7)  # meanwhile a decoded once more: 9 tokens, 8 of them computed
    assert (a.num_tokens, len(a.block_table), b.num_tokens, len(b.block_table)) == (9, 2, 8, 2)
    assert kv.num_free_blocks == 3
    # a's next token takes a block; then both ask for 8 draft slots (2 more blocks each): a gets
    # the last two free blocks, b none but still runs its own token; nobody is preempted.
    batch = sched.schedule({"a": 8, "b": 8})
    assert not batch.preempted and sched.num_preemptions == 0
    assert batch.seqs == [a, b] and batch.num_draft_tokens == [8, 0] and batch.num_new_tokens == [9, 1]
    assert kv.num_free_blocks == 0
    # All of a's draft rejected: the reserved blocks go back.
    sched.update(batch, {"a": [(7, None)], "b": [(7, None)]})
    assert len(a.block_table) == -(-a.num_tokens // BS) == 3 and kv.num_free_blocks == 2


def test_lookahead_is_capped_by_budget_and_max_tokens():
    kv, sched = make(num_blocks=64, budget=6)
    a = _decoding(sched, "a", 3, max_tokens=4)  # one output so far: at most 2 more drafts + 1
    batch = sched.schedule({"a": 8})
    assert batch.num_draft_tokens == [2] and batch.num_new_tokens == [3]
    sched.update(batch, {"a": [(7, None), (7, None), (7, None)]})
    assert a.is_finished and a.finish_reason == "length" and a.num_output_tokens == 4
    b = _decoding(sched, "b", 3)
    c = _decoding(sched, "c", 3)
    batch = sched.schedule({"b": 8, "c": 8})  # budget 6: 2 real tokens, 4 draft slots to share
    assert batch.num_draft_tokens == [4, 0] and batch.num_tokens == 6
    assert (b, c) == tuple(batch.seqs)
