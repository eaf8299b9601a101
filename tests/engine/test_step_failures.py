"""A failing engine step, and an engine loop that cannot carry on, without Ray: a step that
raises fails exactly its batch and leaves the engine as if those requests had been aborted
(no block held, no half-written block findable in the prefix cache), the loop serves the
others on; repeated failures or an injected stop end the loop, which then releases every
block and answers every waiting caller with EngineLoopStopped."""

from __future__ import annotations

import threading
import time

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_errors import EngineLoopStopped, EngineStepError
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.fault_injector import InjectedFault, StepFaults
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

BS = 16
HELD_S = 3600.0  # a hang the test ends (arming again, or stopping the loop), never waits out


def engine_for(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 32)
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=BS, **kw))


def prompt(n: int, salt: int) -> list[int]:
    return [(11 * i + 5 * salt) % 400 + 20 for i in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def assert_baseline(stats) -> None:
    assert stats.num_free_blocks == stats.num_blocks, stats
    assert stats.num_running == stats.num_waiting == 0, stats


def failing_hook(num_failures: list[int]):
    """A layer hook factory (the engine's own extension point) whose steps raise after layer 0
    while num_failures[0] > 0: the forward is half done, like a kernel that fails."""

    def factory(batch):
        if num_failures[0] <= 0:
            return None
        num_failures[0] -= 1

        def on_layer_done(layer: int) -> None:
            if layer == 0:
                raise RuntimeError("kernel failed")

        return on_layer_done

    return factory


def step_until_failed(engine: LLMEngine, hook) -> None:
    """engine.step(hook) until a step raises. With async scheduling a step's failure is raised
    by the step() call that takes it in: the one after the call that submitted it."""
    for _ in range(3):
        engine.step(hook)


def test_a_failed_step_fails_its_batch_and_undoes_it_exactly(tiny_model):
    reference = engine_for(tiny_model).generate([prompt(40, s) for s in range(4)], greedy(6))
    engine = engine_for(tiny_model, max_num_seqs=2)
    for s in range(4):
        engine.add_request(prompt_token_ids=prompt(40, s), params=greedy(6), request_id=f"r{s}")
    fail_next = [1]
    with pytest.raises(EngineStepError, match="kernel failed") as failed:
        step_until_failed(engine, failing_hook(fail_next))  # r0 and r1 prefill: the forward dies after layer 0
    assert failed.value.request_ids == ["r0", "r1"]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_waiting == 2 and stats.num_running == 0
    assert engine.snapshot()[1] == []  # nothing half-written was entered into the prefix cache
    assert set(engine.scheduler.requests) == {"r2", "r3"}

    # The others run as if nothing happened; the failed prompts, sent again, give the reference.
    outputs: dict[str, RequestOutput] = {}
    engine.add_request(prompt_token_ids=prompt(40, 0), params=greedy(6), request_id="r0-again")
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step(failing_hook(fail_next)) if o.finished)
    assert [outputs[r].token_ids for r in ("r0-again", "r2", "r3")] == [reference[i].token_ids for i in (0, 2, 3)]
    assert_baseline(engine.stats())

    # Mid-decode: the prompts' full blocks are cached; a failed decode step caches nothing
    # new, frees every block it had, and the cached prefix is still right.
    for s in (0, 1):
        engine.add_request(prompt_token_ids=prompt(40, s), params=greedy(6), request_id=f"d{s}")
    engine.step()  # both prefill: 2 full blocks each are cached
    engine.step()
    cached = sorted(engine.snapshot()[1])
    fail_next[0] = 1
    with pytest.raises(EngineStepError) as failed:
        step_until_failed(engine, failing_hook(fail_next))
    assert sorted(failed.value.request_ids) == ["d0", "d1"]
    assert sorted(engine.snapshot()[1]) == cached
    assert_baseline(engine.stats())
    again = engine.generate([prompt(40, 1)], greedy(6))[0]
    assert again.token_ids == reference[1].token_ids and again.num_cached_tokens == 32


class Collector:
    """Sinks that record what the loop hands each request: outputs, then the end or an error."""

    def __init__(self):
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.errors: dict[str, Exception] = {}
        self.ended: dict[str, threading.Event] = {}

    def sink(self, request_id: str):
        self.outputs[request_id] = []
        self.ended[request_id] = threading.Event()

        def receive(item) -> None:
            if isinstance(item, Exception):
                self.errors[request_id] = item
            else:
                self.outputs[request_id].append(item)
                if not item.finished:
                    return
            self.ended[request_id].set()

        return receive

    def wait(self, *request_ids: str, timeout_s: float = 30.0) -> None:
        for rid in request_ids:
            assert self.ended[rid].wait(timeout_s), f"{rid} never ended"

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]


def add(loop: EngineLoop, collector: Collector, request_id: str, ids: list[int], max_tokens: int, wait: bool = True):
    seq = loop.engine.make_sequence(None, ids, greedy(max_tokens), request_id)
    added = loop.add_sequence(seq, collector.sink(request_id))
    return added.result(10) if wait else added


def stats_of(loop: EngineLoop):
    return loop.call(lambda e: e.stats()).result(10)


def test_the_loop_fails_only_the_batch_and_serves_on(tiny_model, scheduling):
    reference = engine_for(tiny_model).generate([prompt(20, s) for s in range(5)], greedy(8))
    loop = EngineLoop(engine_for(tiny_model, max_num_seqs=2), name="t").start()
    got = Collector()
    try:
        for s in (0, 1):
            add(loop, got, f"r{s}", prompt(20, s), 400)  # long: running until the fault
        wait_until_output(got, "r0", "r1")
        for s in (2, 3):
            add(loop, got, f"r{s}", prompt(20, s), 8)  # waiting: max_num_seqs is 2
        loop.inject_faults(StepFaults(fail_steps=1))
        armed = {rid: len(got.tokens(rid)) for rid in ("r0", "r1")}  # counted once the fault is armed
        got.wait("r0", "r1")
        # They failed at the next step: at most the step already under way when the fault was
        # armed gave them a token more (counted in steps, not seconds: any machine's speed);
        # with async scheduling also the step before it, whose outputs were still in flight.
        slack = 2 if scheduling == "async" else 1
        assert all(len(got.tokens(rid)) - armed[rid] <= slack for rid in armed), (armed, got.outputs)
        for rid in ("r0", "r1"):
            assert isinstance(got.errors[rid], EngineStepError)
            assert "t: engine step failed" in str(got.errors[rid]) and "injected step failure" in str(got.errors[rid])
        got.wait("r2", "r3")
        assert [got.tokens(r) for r in ("r2", "r3")] == [reference[i].token_ids for i in (2, 3)]
        add(loop, got, "r4", prompt(20, 4), 8)  # and after: still serving
        got.wait("r4")
        assert got.tokens("r4") == reference[4].token_ids and not ({"r2", "r3", "r4"} & set(got.errors))
        assert loop.alive and loop.num_failed_steps == 1 and loop.faults.num_fired == 1
        assert_baseline(stats_of(loop))
    finally:
        loop.stop()


def wait_until_hung(loop: EngineLoop, timeout_s: float = 30.0) -> None:
    """Until a step hangs on the armed fault (the injector counts a hang as it starts)."""
    deadline = time.monotonic() + timeout_s
    while not loop.faults.num_fired:
        assert time.monotonic() < deadline, "no step hung"
        time.sleep(0.01)


def wait_until_output(got: Collector, *request_ids: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(got.outputs[r] for r in request_ids):
        assert time.monotonic() < deadline, "no output yet"
        time.sleep(0.01)


def test_repeated_step_failures_stop_the_loop_and_release_everything(tiny_model):
    loop = EngineLoop(engine_for(tiny_model, max_num_seqs=1), max_consecutive_step_failures=2, name="t").start()
    got = Collector()
    # The first failing step also hangs until everything below is queued (arming again ends the
    # hang; 4 more failing steps): r0 fails, r1 fails, the loop stops with r2 still waiting.
    loop.inject_faults(StepFaults(fail_steps=5, hang_s=HELD_S))
    added = [add(loop, got, f"r{s}", prompt(20, s), 8, wait=False) for s in range(3)]
    held = loop.engine.make_sequence(None, prompt(40, 3), greedy(8), "held")
    reserved = loop.call(lambda e: e.reserve_prompt_blocks(held))  # a decode replica's reservation
    wait_until_hung(loop)
    loop.inject_faults(StepFaults(fail_steps=4))
    assert [f.result(10) for f in added] == [None] * 3 and reserved.result(10) is not None
    got.wait("r0", "r1", "r2")
    assert isinstance(got.errors["r0"], EngineStepError) and isinstance(got.errors["r1"], EngineStepError)
    assert isinstance(got.errors["r2"], EngineLoopStopped)
    assert loop.wait_stopped(5) and not loop.alive
    assert "2 engine steps failed in a row" in loop.stop_reason and "injected step failure" in loop.stop_reason
    assert_baseline(loop.final_stats())  # the reservation and every request were released
    with pytest.raises(EngineLoopStopped, match="engine loop of t stopped"):
        loop.call(lambda e: e.stats()).result(1)  # refused at once, never left hanging
    assert loop.abort("r2").result(1) is None  # nothing left to abort


def test_an_injected_loop_stop_fails_every_request_fast(tiny_model):
    loop = EngineLoop(engine_for(tiny_model), name="t").start()
    got = Collector()
    add(loop, got, "long", prompt(40, 0), 400)
    wait_until_output(got, "long")
    loop.inject_faults(StepFaults(stop_loop=True))
    armed = len(got.tokens("long"))  # counted once the stop is armed
    got.wait("long")
    # It failed before the next step: at most the step under way gave it a token more.
    assert len(got.tokens("long")) - armed <= 1 and isinstance(got.errors["long"], EngineLoopStopped)
    assert isinstance(loop.error, InjectedFault) and "injected loop stop" in loop.stop_reason
    assert loop.wait_stopped(5)
    assert_baseline(loop.final_stats())
    loop.stop()  # stopping a stopped loop is harmless


def test_stop_interrupts_a_hung_step(tiny_model):
    loop = EngineLoop(engine_for(tiny_model), name="t").start()
    got = Collector()
    loop.inject_faults(StepFaults(hang_s=HELD_S))
    add(loop, got, "hung", prompt(20, 0), 8)
    wait_until_hung(loop)
    assert not got.outputs["hung"]  # its step hangs
    loop.stop(timeout_s=30)  # only the interrupt ends the hang: the test waits HELD_S otherwise
    assert loop.wait_stopped(0)
    got.wait("hung", timeout_s=5)
    assert isinstance(got.errors["hung"], EngineLoopStopped) and "shut down" in str(got.errors["hung"])
    assert_baseline(loop.final_stats())


def wait_for_tokens(got: Collector, request_id: str, num: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(got.tokens(request_id)) < num:
        assert time.monotonic() < deadline, f"{request_id} never reached {num} tokens"
        time.sleep(0.01)


def test_a_hold_at_an_output_length_waits_for_every_request_until_released(tiny_model):
    """Armed to hold at 5 output tokens: the first request gets no further than its 5th (6th
    with a step already sampled under async scheduling) however long the test waits. One
    added later ends the held step to join, gets to its own 5th, and then both are held again
    (the first only the few steps past 5 the newcomer needed); arming again releases both to
    finish with every block back."""
    loop = EngineLoop(engine_for(tiny_model), name="t").start()
    got = Collector()
    loop.inject_faults(StepFaults(hold_at_output_tokens=5))
    add(loop, got, "first", prompt(20, 1), 24)
    wait_until_hung(loop)
    wait_for_tokens(got, "first", 5)  # its 5th token's output may be handed over beside the held step
    assert len(got.tokens("first")) <= 6 and not got.ended["first"].is_set()
    add(loop, got, "late", prompt(20, 2), 24)
    wait_for_tokens(got, "late", 5)
    deadline = time.monotonic() + 30
    while not loop.faults.holding:  # held again
        assert time.monotonic() < deadline, "the steps were not held again"
        time.sleep(0.01)
    # Upper bounds the hold enforces: the join lets the held step, the steps until the one
    # that takes it in, and its own 5 through, plus one for async scheduling.
    assert len(got.tokens("late")) <= 6 and len(got.tokens("first")) <= 6 + 8
    assert not got.ended["first"].is_set() and not got.ended["late"].is_set()
    loop.inject_faults(StepFaults())  # released
    got.wait("first", "late")
    assert len(got.tokens("first")) == len(got.tokens("late")) == 24 and not got.errors
    loop.stop()
    assert_baseline(loop.final_stats())


def test_a_held_loop_serves_a_block_reservation(tiny_model):
    """A remote prefill's request asks a held decode loop for its prompt blocks: the held step
    lets the reservation through (without its blocks the request could never join, and the
    hold would wait for it forever), and the steps hold again; the reservation's blocks go
    back when it is released."""
    loop = EngineLoop(engine_for(tiny_model), name="t").start()
    got = Collector()
    loop.inject_faults(StepFaults(hold_at_output_tokens=3))
    add(loop, got, "first", prompt(20, 1), 24)
    wait_until_hung(loop)
    seq = loop.engine.make_sequence(None, prompt(20, 2), greedy(4), "remote")
    reservation = loop.reserve_prompt_blocks(seq).result(timeout=60)
    assert reservation is not None and reservation.block_ids
    deadline = time.monotonic() + 60
    while not loop.faults.holding:  # held again: the reservation is in no step
        assert time.monotonic() < deadline, "the steps were not held again"
        time.sleep(0.01)
    assert not got.ended["first"].is_set()
    loop.inject_faults(StepFaults())
    loop.call(lambda engine: engine.release_reservation("remote")).result(timeout=60)
    got.wait("first")
    loop.stop()
    assert_baseline(loop.final_stats())
