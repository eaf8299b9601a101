"""Scheduling ahead (engine/step_pipeline.py, engine/forward_thread.py): step N+1 is scheduled
and submitted while N's forward runs on the forward thread, with placeholders for N's tokens.
On the real engine: the overlap happens, a request ending in N (max_tokens, a stop token, an
abort) emits nothing past its end and its blocks go back only once no forward writes them,
outputs equal the synchronous step's on mixed batches (prompt chunks, arrivals, preemption,
penalties and seeds), and a failed forward fails only its batch."""

from __future__ import annotations

import threading

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.sequence import SequenceStatus
from splitserve.engine.engine_errors import EngineStepError
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.step_pipeline import StepPipeline
from splitserve.engine.step_timing import StepTiming
from splitserve.proto.messages.sampling_params import SamplingParams

BS = 16


@pytest.fixture(autouse=True)
def every_step_goes_ahead(monkeypatch):
    """These small batches go ahead too (on CPU only steps with >= 4 requests do by default)."""
    monkeypatch.setattr(StepPipeline, "CPU_MIN_REQUESTS", 1)


def engine_for(model_dir: str, async_scheduling: bool = True, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model=model_dir, async_scheduling=async_scheduling, block_size=BS, **kw))


def prompt(n: int, salt: int) -> list[int]:
    return [(17 * i + 5 * salt) % 350 + 20 for i in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def assert_baseline(engine: LLMEngine) -> None:
    assert not engine.has_unfinished() and not engine.pipeline.busy
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.runner.sampler._generators and not engine.outputs._states


def record_commits(engine: LLMEngine) -> list[list[tuple[str, bool]]]:
    """Every submitted batch: (request id, holds a placeholder) per row."""
    batches: list[list[tuple[str, bool]]] = []
    commit = engine.scheduler.commit

    def recording(batch):
        commit(batch)
        batches.append([(s.request_id, p) for s, p in zip(batch.seqs, batch.placeholders)])

    engine.scheduler.commit = recording
    return batches


def record_discarded(engine: LLMEngine) -> list[str]:
    """Requests whose row a batch computed after they had ended (taken in, then discarded)."""
    discarded: list[str] = []
    update = engine.scheduler.update

    def recording(batch, sampled):
        discarded.extend(s.request_id for s in batch.seqs if s.status is SequenceStatus.FINISHED)
        return update(batch, sampled)

    engine.scheduler.update = recording
    return discarded


def record_scheduled_tokens(engine: LLMEngine) -> list[int]:
    """The tokens every scheduled batch computes."""
    counts: list[int] = []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        counts.append(sum(batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = recording
    return counts


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_the_next_step_is_scheduled_while_the_forward_runs(tiny_model):
    """Step 1's forward holds until step 2 was submitted: only scheduling ahead gets there."""
    engine = engine_for(tiny_model)
    second_submitted = threading.Event()
    batches = record_commits(engine)
    commit = engine.scheduler.commit

    def commit_and_signal(batch):
        commit(batch)
        if len(batches) == 2:
            second_submitted.set()

    engine.scheduler.commit = commit_and_signal
    threads, waited, hooked = [], [], []

    def hook(batch):
        first = not hooked
        hooked.append(batch)

        def on_layer_done(layer: int) -> None:
            threads.append(threading.current_thread().name)
            if layer == 0 and first:  # the first step's forward
                waited.append(second_submitted.wait(60))  # a safety net, never the assertion

        return on_layer_done

    engine.add_request(prompt_token_ids=prompt(20, 1), params=greedy(4, ignore_eos=True), request_id="r")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step(hook)
    assert waited == [True] and batches[1] == [("r", True)]  # a decode row on a placeholder
    assert all(name.startswith("engine-forward") for name in threads)
    reference = engine_for(tiny_model, False).generate([prompt(20, 1)], greedy(4, ignore_eos=True))[0]
    assert [t for o in outputs for t in o.new_token_ids] == reference.token_ids
    assert_baseline(engine)


def test_max_tokens_is_never_scheduled_past(tiny_model):
    engine = engine_for(tiny_model)
    batches = record_commits(engine)
    for i, n in enumerate((1, 3, 7)):
        engine.add_request(prompt_token_ids=prompt(10, i), params=greedy(n, ignore_eos=True), request_id=f"m{n}")
    tokens = run_all(engine)
    assert {rid: len(t) for rid, t in tokens.items()} == {"m1": 1, "m3": 3, "m7": 7}
    for n in (1, 3, 7):  # one sampling row per token: none wasted past max_tokens
        assert sum(1 for b in batches for rid, held in b if rid == f"m{n}" and held) == n
    assert_baseline(engine)


def test_a_stop_token_ends_a_request_whose_next_step_is_scheduled(tiny_model):
    ids = prompt(12, 3)
    reference = engine_for(tiny_model, False).generate([ids], greedy(30, ignore_eos=True))[0].token_ids
    stop = reference[5]
    end = reference.index(stop)
    engine = engine_for(tiny_model)
    discarded = record_discarded(engine)
    engine.add_request(prompt_token_ids=ids, params=greedy(30, ignore_eos=True, stop_token_ids=[stop]), request_id="s")
    engine.add_request(prompt_token_ids=prompt(15, 4), params=greedy(12, ignore_eos=True), request_id="other")
    tokens = run_all(engine)
    assert tokens["s"] == reference[: end + 1]  # the stop token is its last; nothing after it
    assert "s" in discarded  # the step after its stop had its row, and dropped it
    assert_baseline(engine)


def test_an_abort_frees_the_blocks_only_once_the_forward_is_done(tiny_model):
    engine = engine_for(tiny_model)
    engine.add_request(prompt_token_ids=prompt(BS * 2 - 1, 1), params=greedy(200, ignore_eos=True), request_id="gone")
    engine.add_request(prompt_token_ids=prompt(9, 2), params=greedy(10, ignore_eos=True), request_id="kept")
    seen = {"gone": 0, "kept": 0}
    for _ in range(3):
        for out in engine.step():
            seen[out.request_id] += len(out.new_token_ids)
    assert engine.pipeline.busy
    gone = engine.scheduler.requests["gone"]
    written = gone.block_table[-1]  # the step in flight writes its decode row here
    engine.abort("gone")
    assert engine.kv.pool.ref_counts[written] == 1  # the forward's own reference: not free yet
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != "gone"
            seen[out.request_id] += len(out.new_token_ids)
    assert seen == {"gone": 2, "kept": 10}
    assert_baseline(engine)


def test_an_abort_of_every_request_in_flight_waits_for_the_forward(tiny_model):
    engine = engine_for(tiny_model)
    engine.add_request(prompt_token_ids=prompt(20, 5), params=greedy(200, ignore_eos=True), request_id="only")
    engine.step()
    engine.step()
    assert engine.pipeline.busy
    engine.abort("only")
    assert_baseline(engine)  # at once: nothing else was running


@pytest.mark.parametrize("chunk", [512, 24])
def test_mixed_batches_match_the_synchronous_step(tiny_model, chunk):
    """Requests arriving while others decode, prompts in chunks of 24 tokens, a pool so small
    that requests are preempted, and penalties, logit_bias, min_tokens and seeds that read
    the tokens of the step still running when the next one is scheduled."""
    sampling = [
        greedy(24, ignore_eos=True),
        greedy(20, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        greedy(18, min_tokens=10, logit_bias={5: 2.0, 9: -3.0}),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=22, ignore_eos=True, logprobs=True),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=16, frequency_penalty=0.4),
        greedy(26, ignore_eos=True),
    ]
    results = {}
    for mode in (False, True):
        engine = engine_for(tiny_model, mode, num_kv_blocks=10, max_num_batched_tokens=chunk)
        pending = [(f"r{i}", prompt(20 + 7 * i, i), p) for i, p in enumerate(sampling)]
        tokens: dict[str, list[int]] = {}
        steps = 0
        while pending or engine.has_unfinished():
            if pending and steps % 3 == 0:  # arrivals while the others decode
                rid, ids, params = pending.pop(0)
                engine.add_request(prompt_token_ids=ids, params=params, request_id=rid)
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            steps += 1
        assert engine.scheduler.num_preemptions > 0  # the pool was too small for all of them
        assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
        results[mode] = tokens
    assert results[True] == results[False]


def test_a_failed_forward_fails_only_its_batch(tiny_model):
    """Step 1 (a and b prefill) fails on the forward thread after step 2 (a and b on
    placeholders, c's prompt) was scheduled: a and b fail, c is served as if alone."""
    engine = engine_for(tiny_model)
    long = greedy(8, ignore_eos=True)
    engine.add_request(prompt_token_ids=prompt(18, 1), params=long, request_id="a")
    engine.add_request(prompt_token_ids=prompt(18, 2), params=long, request_id="b")

    def failing(batch):
        def on_layer_done(layer: int) -> None:
            raise RuntimeError("kernel failed")

        return on_layer_done

    assert engine.step(failing) == []  # submitted; it fails on the forward thread
    engine.add_request(prompt_token_ids=prompt(18, 3), params=long, request_id="c")
    with pytest.raises(EngineStepError, match="kernel failed") as failed:
        engine.step()
    assert sorted(failed.value.request_ids) == ["a", "b"]
    assert engine.pipeline.busy  # step 2 runs on for c
    tokens = run_all(engine)
    reference = engine_for(tiny_model, False).generate([prompt(18, 3)], long)[0].token_ids
    assert tokens == {"c": reference}
    assert_baseline(engine)


def test_few_requests_step_synchronously_on_cpu(tiny_model, monkeypatch):
    """Below CPU_MIN_REQUESTS requests a step runs the synchronous step on the loop thread;
    from it on, steps go ahead on the forward thread; the pipeline drains back as they end."""
    monkeypatch.setattr(StepPipeline, "CPU_MIN_REQUESTS", 3)
    engine = engine_for(tiny_model)
    threads: list[str] = []

    def hook(batch):
        return lambda layer: threads.append(threading.current_thread().name) if layer == 0 else None

    params = [greedy(6 + 4 * i, ignore_eos=True) for i in range(4)]
    for i in (0, 1):
        engine.add_request(prompt_token_ids=prompt(12, i), params=params[i], request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    for _ in range(2):
        for out in engine.step(hook):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert not engine.pipeline.busy
    assert threads == [threading.current_thread().name] * 2  # on the loop thread, in sequence
    for i in (2, 3):
        engine.add_request(prompt_token_ids=prompt(12, i), params=params[i], request_id=f"r{i}")
    engine.step(hook)
    assert engine.pipeline.busy  # submitted to the forward thread
    while engine.has_unfinished():
        for out in engine.step(hook):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert threads[2].startswith("engine-forward")
    assert threads[-1] == threading.current_thread().name  # r3 ended alone: synchronous again
    reference = engine_for(tiny_model, False).generate([prompt(12, i) for i in range(4)], params)
    assert [tokens[f"r{i}"] for i in range(4)] == [o.token_ids for o in reference]
    assert_baseline(engine)


def test_a_forward_waiting_for_the_update_counts_as_exposed_host_work():
    timing = StepTiming()
    timing.forward(10.0, 11.0)
    timing.forward(11.0, 12.0, stalled=0.25)  # queued behind the first: no gap, but it waited
    assert timing.forward_seconds == 1.75 and timing.exposed_host_seconds == 0.25


def test_a_prefix_the_step_in_flight_writes_is_reused_not_recomputed(tiny_model):
    """Two waves of requests on one prompt prefix: the first wave's forward writes the prefix
    blocks while the second wave waits. Scheduled ahead, the second wave waits one step for
    them to enter the prefix cache and reuses them, as the synchronous step does; the tokens are
    the synchronous ones."""
    shared = prompt(4 * BS, 1)
    first = [shared + prompt(5, 10 + i) for i in range(4)]
    second = [shared + prompt(7, 20 + i) for i in range(4)]
    params = greedy(6, ignore_eos=True)
    outputs, computed = {}, {}
    for mode in (False, True):
        engine = engine_for(tiny_model, mode, max_num_batched_tokens=4 * (4 * BS + 5))
        batches = record_scheduled_tokens(engine)
        for i, ids in enumerate(first):
            engine.add_request(prompt_token_ids=ids, params=params, request_id=f"a{i}")
        engine.step()  # the first wave's prompts are scheduled (and, ahead, still running)
        for i, ids in enumerate(second):
            engine.add_request(prompt_token_ids=ids, params=params, request_id=f"b{i}")
        outs: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
        outputs[mode] = {rid: out.token_ids for rid, out in outs.items()}
        computed[mode] = sum(batches)
        assert all(outs[f"b{i}"].num_cached_tokens == 4 * BS for i in range(4)), mode
        assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
        assert not mode or not engine.pipeline.busy
    assert outputs[True] == outputs[False]
    assert computed[True] == computed[False]  # no prefix token computed twice
