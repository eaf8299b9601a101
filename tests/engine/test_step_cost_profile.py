"""The step cost profile (engine/step_cost_profile.py): the EWMAs' arithmetic, a batch's prompt
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


def test_the_ewmas_start_at_the_first_step_and_follow_later_ones():
    profile = StepCostProfile(weight=0.5)
    assert profile.stats() == {"prefill_seconds_per_token": 0.0, "decode_step_seconds": 0.0}
    profile.record(0.08, num_tokens=40, num_prefill_tokens=38)  # mixed: 2 ms a token
    profile.record(0.01, num_tokens=2, num_prefill_tokens=0)  # decode only
    assert profile.stats() == pytest.approx({"prefill_seconds_per_token": 0.002, "decode_step_seconds": 0.01})
    profile.record(0.04, num_tokens=10, num_prefill_tokens=10)  # 4 ms a token
    profile.record(0.03, num_tokens=3, num_prefill_tokens=0)
    assert profile.stats() == pytest.approx({"prefill_seconds_per_token": 0.003, "decode_step_seconds": 0.02})
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
