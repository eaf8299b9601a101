"""The draft-model proposer: draft = target is always accepted, an unrelated draft almost never
(and the adaptive policy then stops speculating), greedy output is identical either way (also
with preemption), sampling keeps the target's distribution with a disagreeing draft, and a
draft with another vocabulary is refused."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.engine.test_rejection_sampling import SIGNIFICANCE, contingency_p_value
from tests.engine.test_speculative import with_step_costs
from tests.helpers.model import make_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, list(range(3, 40)), [9] * 5, [100, 200]]
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def draft_engine(model, draft, policy="fixed", **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    spec = {"method": "draft", "draft_model": str(draft), "policy": policy, "num_speculative_tokens": 4}
    return LLMEngine(EngineConfig(model=str(model), speculative=spec, **kw))


def assert_baseline(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.scheduler.has_unfinished()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_draft_equal_to_target_is_always_accepted(models_root, arch):
    model = make_checkpoint(models_root, "tiny", arch)
    plain = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=128)).generate(PROMPTS, GREEDY)
    engine = draft_engine(model, model, max_num_batched_tokens=48)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert stats.spec_method == "draft" and stats.spec_proposed_tokens > 100
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens  # acceptance rate 1.0
    assert_baseline(engine)
    # Sampling (unseeded): rejection sampling with q = p accepts everything too.
    sampled = draft_engine(model, model)
    sampled.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True))
    stats = sampled.stats()
    assert stats.spec_accepted_tokens >= 0.97 * stats.spec_proposed_tokens


def test_unrelated_draft_is_rejected_and_the_policy_turns_it_off(models_root, tiny_model):
    unrelated = make_checkpoint(models_root, "tiny", "llama", seed=3)
    plain = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128)).generate(PROMPTS, GREEDY)
    fixed = draft_engine(tiny_model, unrelated)
    assert [o.token_ids for o in fixed.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain]
    stats = fixed.stats()
    assert stats.spec_accepted_tokens < 0.05 * stats.spec_proposed_tokens
    adaptive = with_step_costs(draft_engine(tiny_model, unrelated, policy="adaptive"))
    assert [o.token_ids for o in adaptive.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain]
    hist = adaptive.stats().spec_k_histogram
    assert hist[0] > 0.9 * sum(hist), hist
    assert_baseline(adaptive)


def test_preemption_restarts_the_drafts_kv(tiny_model):
    prompts = [list(range(5 + i, 25 + i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128)).generate(prompts, params)
    tight = draft_engine(tiny_model, tiny_model, num_kv_blocks=10, block_size=16)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = tight.stats()
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens > 0  # its KV was rebuilt correctly
    assert_baseline(tight)


def perturbed_copy(model_dir, out_dir, scale: float):
    """The checkpoint with noise on its output layer: a draft that mostly agrees, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    weights = load_file(out_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = head + scale * head.std() * torch.randn(head.shape, generator=generator)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def test_sampling_with_a_disagreeing_draft_keeps_the_distribution(tmp_path, tiny_model):
    unrelated = perturbed_copy(Path(tiny_model), tmp_path / "draft", scale=1.0)
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    num_samples = 1500

    def samples(engine):
        return [tuple(o.token_ids) for o in engine.generate([prompt] * num_samples, params)]

    plain = samples(LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=1024, max_num_seqs=256, seed=7)))
    engine = draft_engine(tiny_model, unrelated, num_kv_blocks=1024, max_num_seqs=256, seed=11)
    spec = samples(engine)
    stats = engine.stats()
    assert 0.05 < stats.spec_accepted_tokens / stats.spec_proposed_tokens < 0.95  # rejections happen
    for cells in (lambda s: s[:2], lambda s: s[1:]):
        assert contingency_p_value(Counter(map(cells, plain)), Counter(map(cells, spec))) > SIGNIFICANCE


def test_a_draft_with_another_vocabulary_is_refused(models_root, tiny_model):
    other_vocab = make_checkpoint(models_root, "draft", "llama")
    with pytest.raises(ConfigError, match="same tokenizer"):
        draft_engine(tiny_model, other_vocab)
    with pytest.raises(ConfigError, match="draft_model"):
        LLMEngine(EngineConfig(model=tiny_model, speculative={"method": "draft"}))


def test_a_long_prompt_reaches_the_draft_in_chunks(tiny_model):
    prompts = [list(range(5, 105)), [7, 8, 9]]  # 100 prompt tokens: four 32-token chunks
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128)).generate(prompts, params)
    engine = draft_engine(tiny_model, tiny_model)
    proposer = engine.speculator.draft_proposer
    proposer.max_prompt_chunk = 32
    fed = []
    original = proposer._forward
    proposer._forward = lambda seqs, starts, chunks: fed.append(max(map(len, chunks))) or original(seqs, starts, chunks)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    assert max(fed) == 32  # never more than a chunk in one pass
    stats = engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens > 0
    assert_baseline(engine)
