"""The step cost profile (engine/step_cost_profile.py): the prefill line (fixed cost plus cost
per token) and its fallback, the decode EWMA, a batch's prompt
tokens, and a real engine (synchronous and async scheduling) reporting nothing while cold, a
prefill cost once a prompt ran and a decode step once decode-only steps did; the prefill
figure does not move while only decode steps run."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.scheduled_batch import ScheduledBatch
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.step_cost_profile import StepCostProfile
from splitserve.engine.step_pipeline import StepPipeline
from splitserve.proto.messages.sampling_params import SamplingParams


def line(n: int) -> float:
    """A replica whose prefilling step costs 5 ms plus 0.1 ms a token."""
    return 0.005 + 1e-4 * n


def test_a_prefilling_step_is_priced_as_a_fixed_cost_plus_a_cost_per_token():
    profile = StepCostProfile(weight=0.5)
    cold = {"prefill_step_seconds": 0.0, "prefill_seconds_per_token": 0.0, "decode_step_seconds": 0.0}
    assert profile.stats() == cold
    profile.record(line(40), num_tokens=40, num_prefill_tokens=38)  # one size: no line yet
    assert profile.prefill_line() == pytest.approx((0.0, line(40) / 40))
    # Mostly short prompts (a decode replica's local remainders), now and then a long one: the
    # line still prices a long prompt right, where seconds per token read off the short steps
    # (5.8 ms / 8 tokens = 0.725 ms) would overprice 200 tokens 3.5x.
    for n in (8, 8, 200, 8, 8, 8):
        profile.record(line(n), num_tokens=n, num_prefill_tokens=n)
    step, per_token = profile.prefill_line()
    assert (step, per_token) == pytest.approx((0.005, 1e-4))
    assert step + 200 * per_token == pytest.approx(line(200))
    assert profile.stats()["prefill_step_seconds"] == pytest.approx(0.005)


def test_a_line_through_odd_steps_falls_back_to_the_ratio_of_means():
    profile = StepCostProfile(weight=0.5)
    profile.record(0.05, num_tokens=10, num_prefill_tokens=10)  # longer steps ran faster: noise
    profile.record(0.01, num_tokens=100, num_prefill_tokens=100)
    step, per_token = profile.prefill_line()
    assert step == 0.0 and per_token == pytest.approx((0.05 + 0.01) / (10 + 100))


def test_the_decode_step_is_an_ewma_of_decode_only_steps():
    profile = StepCostProfile(weight=0.5)
    profile.record(0.01, num_tokens=2, num_prefill_tokens=0)
    profile.record(0.03, num_tokens=3, num_prefill_tokens=0)
    assert profile.decode_step_seconds == pytest.approx(0.02)
    assert profile.prefill_line() == (0.0, 0.0)  # decode steps say nothing about prefill
    profile.record(5.0, num_tokens=0, num_prefill_tokens=0)  # shape unknown: ignored
    assert profile.decode_step_seconds == pytest.approx(0.02)
    with pytest.raises(ValueError):
        StepCostProfile(weight=0.0)


def test_a_batch_counts_its_prompt_chunks_not_its_decode_rows_or_drafts():
    batch = ScheduledBatch(num_new_tokens=[16, 1, 4, 1], num_draft_tokens=[0, 0, 3, 0])
    assert batch.num_prefill_tokens == 16 and batch.num_tokens == 22


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_real_engine_measures_its_prefill_and_decode_steps(tiny_model, async_scheduling, monkeypatch):
    monkeypatch.setattr(StepPipeline, "CPU_MIN_REQUESTS", 1)  # one request goes ahead too
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32, async_scheduling=async_scheduling))
    assert (engine.stats().prefill_seconds_per_token, engine.stats().decode_step_seconds) == (0.0, 0.0)
    prompt = [(7 * i) % 200 + 20 for i in range(24)]
    engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.stats().prefill_seconds_per_token == 0.0:
        assert engine.has_unfinished()
        engine.step()
    after_prefill = engine.stats().prefill_seconds_per_token
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.prefill_seconds_per_token == after_prefill > 0  # only decode steps since
    assert stats.decode_step_seconds > 0
