"""The step cost profile (engine/step_cost_profile.py): the prefill line (fixed cost plus cost
per token) and its fallback, a fresh prompt's steps on a line of their own, the decode EWMA, a
batch's prompt tokens and whether it is a fresh prompt alone, and a real engine (synchronous and async scheduling) reporting nothing while cold, a
prefill cost once a prompt ran and a decode step once decode-only steps did; the prefill
figure does not move while only decode steps run."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.scheduled_batch import ScheduledBatch
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.step_cost_profile import StepCostProfile
from splitserve.engine.step_pipeline import StepPipeline
from splitserve.proto.messages.sampling_params import SamplingParams


def line(n: int) -> float:
    """A replica whose prefilling step costs 5 ms plus 0.1 ms a token."""
    return 0.005 + 1e-4 * n


def test_a_prefilling_step_is_priced_as_a_fixed_cost_plus_a_cost_per_token():
    profile = StepCostProfile(weight=0.5)
    cold = dict.fromkeys(
        [
            "prefill_step_seconds",
            "prefill_seconds_per_token",
            "fresh_prefill_step_seconds",
            "fresh_prefill_seconds_per_token",
            "decode_step_seconds",
        ],
        0.0,
    )
    assert profile.stats() == cold
    profile.record(line(40), num_tokens=40, num_prefill_tokens=38)  # one size: no line yet
    assert profile.mixed_prefill.fit() == pytest.approx((0.0, line(40) / 40))
    # Mostly short prompts (a decode replica's local remainders), now and then a long one: the
    # line still prices a long prompt right, where seconds per token read off the short steps
    # (5.8 ms / 8 tokens = 0.725 ms) would overprice 200 tokens 3.5x.
    for n in (8, 8, 200, 8, 8, 8):
        profile.record(line(n), num_tokens=n, num_prefill_tokens=n)
    step, per_token = profile.mixed_prefill.fit()
    assert (step, per_token) == pytest.approx((0.005, 1e-4))
    assert step + 200 * per_token == pytest.approx(line(200))
    assert profile.stats()["prefill_step_seconds"] == pytest.approx(0.005)


def test_a_line_through_odd_steps_falls_back_to_the_ratio_of_means():
    profile = StepCostProfile(weight=0.5)
    profile.record(0.05, num_tokens=10, num_prefill_tokens=10)  # longer steps ran faster: noise
    profile.record(0.01, num_tokens=100, num_prefill_tokens=100)
    step, per_token = profile.mixed_prefill.fit()
    assert step == 0.0 and per_token == pytest.approx((0.05 + 0.01) / (10 + 100))


def test_a_fresh_prompts_steps_keep_a_line_of_their_own():
    """A fresh prompt alone (the scripted prefill) costing 1 ms + 20 us a token, tails and mixed
    steps (the eager forward) 5 ms + 100 us: neither line moves with the other's steps."""
    profile = StepCostProfile(weight=0.5)
    for n, fresh in ((200, True), (32, False), (1000, True), (8, False), (256, True), (200, False)):
        profile.record((0.001 + 2e-5 * n) if fresh else line(n), num_tokens=n, num_prefill_tokens=n, fresh_prompt=fresh)
    assert profile.fresh_prefill.fit() == pytest.approx((0.001, 2e-5))
    assert profile.mixed_prefill.fit() == pytest.approx((0.005, 1e-4))
    stats = profile.stats()
    assert (stats["fresh_prefill_step_seconds"], stats["fresh_prefill_seconds_per_token"]) == pytest.approx(
        (0.001, 2e-5)
    )
    assert (stats["prefill_step_seconds"], stats["prefill_seconds_per_token"]) == pytest.approx((0.005, 1e-4))


def test_the_decode_step_is_an_ewma_of_decode_only_steps():
    profile = StepCostProfile(weight=0.5)
    profile.record(0.01, num_tokens=2, num_prefill_tokens=0)
    profile.record(0.03, num_tokens=3, num_prefill_tokens=0)
    assert profile.decode_step_seconds == pytest.approx(0.02)
    assert profile.mixed_prefill.fit() == (0.0, 0.0)  # decode steps say nothing about prefill
    profile.record(5.0, num_tokens=0, num_prefill_tokens=0)  # shape unknown: ignored
    assert profile.decode_step_seconds == pytest.approx(0.02)
    with pytest.raises(ValueError):
        StepCostProfile(weight=0.0)


def test_a_batch_counts_its_prompt_chunks_not_its_decode_rows_or_drafts():
    batch = ScheduledBatch(num_new_tokens=[16, 1, 4, 1], num_draft_tokens=[0, 0, 3, 0])
    assert batch.num_prefill_tokens == 16 and batch.num_tokens == 22


def test_a_batch_is_a_fresh_prompt_when_one_prompt_starts_alone():
    def batch(*rows: tuple[int, int], starts: list[int] | None = None) -> ScheduledBatch:
        """rows: (tokens already computed, tokens this step)."""
        seqs = [Sequence(f"r{i}", list(range(1, 300)), SamplingParams(), block_size=16) for i in range(len(rows))]
        for seq, (computed, _) in zip(seqs, rows, strict=True):
            seq.num_computed_tokens = computed
        return ScheduledBatch(seqs, [n for _, n in rows], num_draft_tokens=[0] * len(rows), starts=starts)

    assert batch((0, 200)).is_fresh_prompt
    assert not batch((224, 32)).is_fresh_prompt  # a tail after a prefix hit
    assert not batch((0, 200), (40, 1)).is_fresh_prompt  # mixed with a decode row
    assert not batch((0, 100), (0, 100)).is_fresh_prompt  # two prompts
    assert not batch((10, 1)).is_fresh_prompt  # one decode row
    assert batch((200, 200), starts=[0]).is_fresh_prompt  # async: committed, its start kept
    assert not batch((232, 32), starts=[200]).is_fresh_prompt


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_real_engine_measures_its_prefill_and_decode_steps(tiny_model, async_scheduling, monkeypatch):
    monkeypatch.setattr(StepPipeline, "CPU_MIN_REQUESTS", 1)  # one request goes ahead too
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32, async_scheduling=async_scheduling))
    assert (engine.stats().prefill_seconds_per_token, engine.stats().decode_step_seconds) == (0.0, 0.0)
    prompt = [(7 * i) % 200 + 20 for i in range(24)]
    engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.stats().fresh_prefill_seconds_per_token == 0.0:  # one prompt alone: the fresh line
        assert engine.has_unfinished()
        engine.step()
    after_prefill = engine.stats().fresh_prefill_seconds_per_token
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.fresh_prefill_seconds_per_token == after_prefill > 0  # only decode steps since
    assert stats.prefill_seconds_per_token == 0.0  # no tail or mixed step ran
    assert stats.decode_step_seconds > 0
