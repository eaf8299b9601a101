"""Each CPU rank's forward thread on cores of its own (engine/parallel/rank_cpus.py): the blocks
the driver assigns, none on a node with fewer cores than ranks, the driver's thread put back on
its cores when the engine closes (also when two engines pinned it), and a real TP-2 engine's
two ranks each on its own block -- the same greedy tokens pinned or not."""

from __future__ import annotations

import os
import threading

import pytest

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.parallel.rank_cpus import PinnedThreads, node_cores, rank_cores
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import make_checkpoint

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="pinning two ranks apart needs two cores")
PROMPTS = [[5, 17, 33, 2, 9, 41, 77], [100, 3, 8, 12, 60]]


def test_each_rank_gets_its_own_block_of_the_drivers_cores():
    assert [rank_cores(r, 2, [0, 1]) for r in range(2)] == [(0,), (1,)]
    assert [rank_cores(r, 2, list(range(8))) for r in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [rank_cores(r, 2, [2, 5, 7]) for r in range(2)] == [(2,), (5,)]  # the set's own ids
    assert [rank_cores(r, 4, list(range(6))) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert rank_cores(0, 2, [3]) is None  # fewer cores than ranks: nothing is pinned
    assert rank_cores(1, 4, [0, 1, 2]) is None


def _in_a_thread(body) -> None:
    """Run body on a fresh thread that may use every core (this one may be pinned by an engine
    an earlier test left to the collector); its assertion errors fail the test."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            os.sched_setaffinity(0, CORES)
            body()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


@needs_two_cores
def test_a_pinned_thread_is_put_back_once_its_last_holder_releases_it():
    def body() -> None:
        first, second = PinnedThreads((CORES[1],)), PinnedThreads((CORES[1],))
        try:
            first.pin_calling_thread()
            assert os.sched_getaffinity(0) == {CORES[1]}
            second.pin_calling_thread()
            first.release()
            assert os.sched_getaffinity(0) == {CORES[1]}  # the second engine still holds it
            second.release()
            assert os.sched_getaffinity(0) == set(CORES)
        finally:
            first.release()
            second.release()
        PinnedThreads(None).pin_calling_thread()  # no cores: nothing pinned
        assert os.sched_getaffinity(0) == set(CORES)

    _in_a_thread(body)


@needs_two_cores
def test_node_cores_are_the_main_threads_before_a_rank_pinned_it():
    main_before = os.sched_getaffinity(0)  # this test runs on the main thread
    pinned = PinnedThreads((CORES[0],))
    try:
        pinned.pin_calling_thread()
        assert os.sched_getaffinity(0) == {CORES[0]}
        assert set(node_cores()) >= main_before  # the set before the pin, not the pin
        assert len(node_cores()) >= 2
    finally:
        pinned.release()
    assert os.sched_getaffinity(0) == main_before


def _thread_cores(pid: int) -> set[int]:
    """The cores the process's main thread may run on (the follower's forward thread)."""
    return os.sched_getaffinity(pid)


@needs_two_cores
def test_a_tp2_engines_ranks_run_on_cores_of_their_own(models_root):
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    before = os.sched_getaffinity(0)
    for pin in (True, False):
        engine = LLMEngine(
            EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=2, tensor_parallel_pin_cpus=pin)
        )
        try:
            (follower,) = engine.tensor_parallel.pids
            outputs[pin] = [out.token_ids for out in engine.generate(PROMPTS, params)]
            if pin:
                assert os.sched_getaffinity(0) == set(rank_cores(0, 2, CORES))  # this thread ran rank 0
                assert _thread_cores(follower) == set(rank_cores(1, 2, CORES))
            else:
                assert os.sched_getaffinity(0) == before
                assert _thread_cores(follower) == before
        finally:
            engine.close()
        assert os.sched_getaffinity(0) == before  # closed: the driver's thread is back on every core
    assert outputs[True] == outputs[False]


def test_pin_cpus_must_be_a_bool():
    with pytest.raises(ConfigError, match="tensor_parallel_pin_cpus must be true or false"):
        EngineConfig(model="m", tensor_parallel_pin_cpus="yes")
