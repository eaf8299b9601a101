"""Async scheduling (engine/step_pipeline.py) against the synchronous step, on the real engine:
the same outputs (greedy, seeded sampling, stop strings), nothing emitted past a request's end
when a stop string or an abort ends it while its next step is already running, a failure
building a step's outputs fails only that step's batch, and every block back in the pool."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.sequence import SequenceStatus
from splitserve.engine.engine_errors import EngineStepError
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.step_pipeline import StepPipeline
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.engine.test_step_failures import Collector


@pytest.fixture(scope="module", autouse=True)
def every_step_goes_ahead():
    """These small batches go ahead too (on CPU only steps with >= 4 requests do by default)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepPipeline, "CPU_MIN_REQUESTS", 1)
        yield


def engine_for(model_dir: str, async_scheduling: bool, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model=model_dir, async_scheduling=async_scheduling, **kw))


@pytest.fixture(scope="module")
def engines(tiny_model, every_step_goes_ahead) -> dict[str, LLMEngine]:
    return {"async": engine_for(tiny_model, True), "sync": engine_for(tiny_model, False)}


def prompt(n: int, salt: int) -> list[int]:
    return [(13 * i + 7 * salt) % 300 + 20 for i in range(n)]


def assert_baseline(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.has_unfinished()
    assert not engine.runner.sampler._generators  # no seeded generator left behind
    assert not engine.outputs._states  # no detokenizer state left behind


def outputs_of(engine: LLMEngine, prompts, params):
    return [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(prompts, params)]


def test_the_switch_picks_the_step(engines):
    assert engines["async"].pipeline is not None and engines["async"].stats().async_scheduling
    assert engines["sync"].pipeline is None and not engines["sync"].stats().async_scheduling


def test_greedy_output_is_identical(engines):
    prompts = [prompt(5 + 9 * i, i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * i, ignore_eos=i % 2 == 0) for i in range(6)]
    results = {mode: outputs_of(engine, prompts, params) for mode, engine in engines.items()}
    assert results["async"] == results["sync"]
    for engine in engines.values():
        assert_baseline(engine)


def test_seeded_sampling_is_reproducible(engines):
    prompts = [prompt(12, i) for i in range(4)]
    params = [
        SamplingParams(
            temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2
        )
        for i in range(4)
    ]
    first = outputs_of(engines["async"], prompts, params)
    assert outputs_of(engines["async"], prompts, params) == first
    assert outputs_of(engines["sync"], prompts, params) == first
    for engine in engines.values():
        assert_baseline(engine)


def test_a_stop_string_ends_a_request_whose_next_step_runs(engines):
    """The stop string is found while the next step runs with the request: that step's token
    for it is discarded, its output ends exactly where the synchronous step's ends."""
    ids, long = prompt(10, 3), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = engines["sync"].generate([ids], long)[0].text
    start = next(k for k in range(8, len(text) - 3) if text.find(text[k : k + 3]) == k)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[start : start + 3]], seed=1)
    engine = engines["async"]
    discarded = []
    update = engine.scheduler.update

    def recording_update(batch, sampled):
        discarded.extend(s.request_id for s in batch.seqs if s.status is SequenceStatus.FINISHED)
        return update(batch, sampled)

    engine.scheduler.update = recording_update
    try:
        got = engine.generate([ids, prompt(30, 4)], [params, long])
    finally:
        del engine.scheduler.update
    want = engines["sync"].generate([ids, prompt(30, 4)], [params, long])
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in want
    ]
    assert got[0].text == text[:start] and got[0].finish_reason == "stop"
    assert got[0].request_id in discarded  # the next step had it, and dropped its row
    assert_baseline(engine)


def test_an_abort_while_the_next_step_runs_emits_nothing_more(engines):
    engine = engines["async"]
    engine.add_request(
        prompt_token_ids=prompt(9, 5), params=SamplingParams(max_tokens=500, ignore_eos=True), request_id="gone"
    )
    engine.add_request(
        prompt_token_ids=prompt(9, 6), params=SamplingParams(temperature=0, max_tokens=12), request_id="kept"
    )
    seen: dict[str, list[int]] = {"gone": [], "kept": []}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id].extend(out.new_token_ids)
    assert engine.pipeline.busy  # the last step's tokens are in, its outputs not built yet
    engine.abort("gone")
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != "gone"
            seen[out.request_id].extend(out.new_token_ids)
    assert len(seen["gone"]) == 3  # steps 1-3's tokens; step 4's was never emitted
    assert (
        seen["kept"]
        == engines["sync"].generate([prompt(9, 6)], SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    )
    assert_baseline(engine)


def test_a_failure_building_outputs_fails_only_its_batch(tiny_model):
    engine = engine_for(tiny_model, True)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for rid, salt in (("a", 1), ("b", 2)):
        engine.add_request(prompt_token_ids=prompt(8, salt), params=greedy, request_id=rid)
    engine.step()  # a and b prefill; their outputs pending
    engine.add_request(prompt_token_ids=prompt(8, 3), params=greedy, request_id="c")  # joins the next batch only
    process = engine.outputs.process

    def failing(seq):
        if seq.request_id == "a":
            raise RuntimeError("detokenizer failed")
        return process(seq)

    engine.outputs.process = failing
    with pytest.raises(EngineStepError) as failed:
        engine.step()
    engine.outputs.process = process
    assert sorted(failed.value.request_ids) == ["a", "b"]
    final = {}
    while engine.has_unfinished():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert (
        set(final) == {"c"}
        and final["c"].token_ids == engine_for(tiny_model, False).generate([prompt(8, 3)], greedy)[0].token_ids
    )
    assert_baseline(engine)


def test_the_loop_delivers_from_the_output_thread_and_reports_timing(tiny_model):
    loop = EngineLoop(engine_for(tiny_model, True), name="t").start()
    got = Collector()
    try:
        for i in range(3):
            seq = loop.engine.make_sequence(None, prompt(7, i), SamplingParams(temperature=0, max_tokens=9), f"r{i}")
            loop.add_sequence(seq, got.sink(f"r{i}")).result(10)
        got.wait("r0", "r1", "r2")
        stats = loop.call(lambda e: e.stats()).result(10)
    finally:
        loop.stop()
    reference = engine_for(tiny_model, False).generate(
        [prompt(7, i) for i in range(3)], SamplingParams(temperature=0, max_tokens=9)
    )
    assert [got.tokens(f"r{i}") for i in range(3)] == [o.token_ids for o in reference]
    assert stats.num_free_blocks == stats.num_blocks and stats.async_scheduling
    assert stats.num_timed_steps > 0 and stats.step_forward_seconds > 0 and stats.step_host_seconds > 0
