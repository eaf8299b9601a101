"""The cap on a mixed step's prompt tokens (Scheduler's mixed_step_prefill_tokens): a step that
carries decode rows computes at most that many prompt tokens (running chunks and admissions
together), a step with none the whole budget; in the synchronous and the scheduled-ahead step,
and on the real engine with the same greedy tokens as without the cap."""

from __future__ import annotations

import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.worker_pool import engine_config_for
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.scheduler import Scheduler
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.scheduler_steps import fake_step

BS = 4


def make(cap: int, budget: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(64, BS), 8, budget, 512, [0], mixed_step_prefill_tokens=cap)


def seq(request_id: str, prompt_len: int, max_tokens: int = 20) -> Sequence:
    """A prompt of its own (no prefix-cache hit on another's blocks)."""
    first = 1000 * ord(request_id)
    prompt = list(range(first, first + prompt_len))
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), BS)


def decoding(sched: Scheduler, request_id: str = "d") -> Sequence:
    """A running sequence past its prompt: its next step is a decode row."""
    d = seq(request_id, 8)
    sched.add(d)
    fake_step(sched)
    assert d.num_output_tokens == 1
    return d


def test_a_prompt_alone_takes_the_whole_budget():
    sched = make(cap=16)
    sched.add(seq("p", 50))
    assert fake_step(sched).num_new_tokens == [50]  # one step: no decode row waits for it


def test_a_step_with_decode_rows_takes_at_most_the_cap_of_prompt_tokens():
    sched = make(cap=16)
    d = decoding(sched)
    p, q = seq("p", 40), seq("q", 40)
    sched.add(p)
    sched.add(q)
    steps = [fake_step(sched) for _ in range(3)]
    # The decode row every step; p's chunks under the cap, q admitted only once p's is done.
    assert [b.seqs for b in steps] == [[d, p], [d, p], [d, p, q]]
    assert [b.num_new_tokens for b in steps] == [[1, 16], [1, 16], [1, 8, 8]]
    assert p.num_output_tokens == 1


def test_without_the_cap_the_step_fills_its_budget():
    sched = make(cap=0)
    d = decoding(sched)
    sched.add(seq("p", 40))
    sched.add(seq("q", 40))
    batch = fake_step(sched)
    assert batch.seqs[0] is d and batch.num_new_tokens == [1, 40, 23]


def test_the_cap_above_the_budget_is_the_budget():
    sched = make(cap=100, budget=32)
    decoding(sched)
    sched.add(seq("p", 40))
    assert fake_step(sched).num_new_tokens == [1, 31]


def test_scheduled_ahead_a_decode_row_on_a_placeholder_counts():
    """Async scheduling: the step scheduled while one runs sees d's token as a placeholder."""
    sched = make(cap=16)
    d = decoding(sched)
    sched.add(seq("p", 40))
    first = sched.schedule()
    sched.commit(first)
    assert first.num_new_tokens == [1, 16]
    ahead = sched.schedule(ahead=True)
    assert ahead.seqs[0] is d and ahead.num_new_tokens == [1, 16]


def test_a_sequence_whose_last_token_is_in_flight_is_no_decode_row():
    """Its last token is in the step in flight: nothing of it runs ahead, so the prompt that
    arrives meanwhile prefills in one step as if alone."""
    sched = make(cap=16)
    d = seq("d", 8, max_tokens=2)
    sched.add(d)
    fake_step(sched)
    sched.commit(last := sched.schedule())
    assert last.seqs == [d]
    sched.add(seq("p", 40))
    assert sched.schedule(ahead=True).num_new_tokens == [40]


def test_the_cap_must_not_be_negative():
    with pytest.raises(ConfigError, match="mixed_step_prefill_tokens"):
        EngineConfig(model="m", mixed_step_prefill_tokens=-1)


def test_the_engine_decodes_alike_with_the_cap(tiny_model):
    """The real engine: a long prompt arriving while one decodes runs in chunks of the cap, and
    every request's greedy tokens are those of the uncapped engine."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = {"a": [(7 * i) % 300 + 20 for i in range(12)], "b": [(11 * i) % 300 + 20 for i in range(90)]}
    tokens = {}
    for cap in (0, 32):
        engine = LLMEngine(
            EngineConfig(model=tiny_model, block_size=16, num_kv_blocks=64, mixed_step_prefill_tokens=cap)
        )
        steps: list[dict[str, int]] = []  # request id -> tokens, per scheduled step
        schedule = engine.scheduler.schedule

        def recording(*args, schedule=schedule, steps=steps, **kwargs):
            batch = schedule(*args, **kwargs)
            steps.append({s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)})
            return batch

        engine.scheduler.schedule = recording
        engine.add_request(prompt_token_ids=prompts["a"], params=params, request_id="a")
        out: dict[str, list[int]] = {}
        for _ in range(2):  # a's prompt, then its first decode step
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.add_request(prompt_token_ids=prompts["b"], params=params, request_id="b")
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        tokens[cap] = out
        b_chunks = [(step.get("a"), step["b"]) for step in steps if step.get("b", 0) > 1]
        # a decodes beside each of b's chunks: 90 tokens in chunks of the cap, or in one.
        assert b_chunks == ([(1, 32), (1, 32), (1, 26)] if cap else [(1, 90)])
        assert engine.kv.num_free_blocks == 64
    assert tokens[32] == tokens[0] and len(tokens[0]["b"]) == 6


def test_the_pool_setting_reaches_the_engine():
    cfg = ServeConfig.model_validate({"decode": {"mixed_step_prefill_tokens": 512}})
    assert engine_config_for(cfg, cfg.decode, "m")["mixed_step_prefill_tokens"] == 512
    assert engine_config_for(cfg, cfg.prefill, "m")["mixed_step_prefill_tokens"] == 0
