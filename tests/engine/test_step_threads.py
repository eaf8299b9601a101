"""Each step's torch threads by its size (engine/step_threads.py): a real engine runs a prompt
chunk at or above threaded_step_min_tokens on all its threads and smaller steps on one, with
the same greedy tokens as an engine that runs every step on all of them."""

from __future__ import annotations

import pytest
import torch

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.worker_pool import engine_config_for
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.step_threads import StepThreads
from splitserve.proto.messages.sampling_params import SamplingParams


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _generate(model_dir: str, min_tokens: int, prompt: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Greedy tokens, and (tokens in the forward, torch threads during it) for each forward,
    from an engine built on two torch threads (a process-wide setting the last one changed)."""
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, threaded_step_min_tokens=min_tokens))
    model = engine.runner.model
    forward = model.forward
    seen: list[tuple[int, int]] = []

    def recording_forward(input_ids, *args, **kwargs):
        seen.append((int(input_ids.shape[0]), torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    model.forward = recording_forward
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [out] = engine.generate([prompt], params)
    return list(out.token_ids), seen


@pytest.mark.usefixtures("two_torch_threads")
def test_small_steps_run_on_one_thread_and_large_ones_on_all(tiny_model):
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    tokens, seen = _generate(tiny_model, 32, prompt)
    assert seen[0] == (40, 2)  # the prompt: 40 tokens >= 32
    assert seen[1:] and all(step == (1, 1) for step in seen[1:])  # one decode token each
    every_step_threaded, seen_all = _generate(tiny_model, 0, prompt)
    assert all(threads == 2 for _, threads in seen_all)
    assert tokens == every_step_threaded
    short_tokens, seen_short = _generate(tiny_model, 64, prompt)  # the prompt is small too
    assert all(threads == 1 for _, threads in seen_short)
    assert short_tokens == tokens


@pytest.mark.usefixtures("two_torch_threads")
def test_threads_for_and_its_limits():
    threads = StepThreads(16)
    assert threads.max_threads == 2
    assert [threads.threads_for(n) for n in (1, 15, 16, 2048)] == [1, 1, 2, 2]
    threads.enter(1)
    assert torch.get_num_threads() == 1
    threads.enter(16)
    assert torch.get_num_threads() == 2
    StepThreads(0).enter(1)  # off: leaves torch's setting alone
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="min_tokens"):
        StepThreads(-1)
    with pytest.raises(ConfigError, match="threaded_step_min_tokens"):
        EngineConfig(model="unused", threaded_step_min_tokens=-1)


def test_pool_setting_reaches_the_engine_config():
    cfg = ServeConfig.model_validate({"decode": {"threaded_step_min_tokens": 96}})
    assert engine_config_for(cfg, cfg.decode, "m")["threaded_step_min_tokens"] == 96
    assert engine_config_for(cfg, cfg.prefill, "m")["threaded_step_min_tokens"] == cfg.prefill.threaded_step_min_tokens
