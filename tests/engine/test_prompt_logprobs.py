"""Prompt log-probabilities in the engine (SamplingParams.prompt_logprobs): every prompt
token's log-probability given the tokens before it, and its top alternatives, equal
transformers' log_softmax on the same checkpoint (fp32), across several blocks and prefill
chunks, in a mixed batch, after a preemption, and again when the prompt is prefix-cached
(such a request recomputes every position instead of reading cached blocks)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

TOL = 1e-4
PROMPT = [(37 * i) % 500 + 5 for i in range(70)]  # 5 blocks of 16; 5 chunks at a 16-token budget


def engine_for(model_dir: str, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model=model_dir, **kw))


def assert_baseline(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """prompt -> transformers' log_softmax over the vocabulary at every prompt position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            return torch.log_softmax(model(ids, attention_mask=torch.ones_like(ids)).logits[0].float(), dim=-1)

    return run


def assert_matches(out, prompt: list[int], reference, k: int) -> None:
    if len(prompt) == 1:  # nothing comes before its only token
        assert out.prompt_logprobs == [] and out.prompt_top_logprobs == [] and out.prompt_ranks == []
        return
    ref = reference(prompt)
    expected = ref[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert len(out.prompt_logprobs) == len(prompt) - 1
    assert (torch.tensor(out.prompt_logprobs) - expected).abs().max().item() < TOL
    # Rank as vLLM's (1 + how many tokens are more likely), up to ties within the tolerance.
    low = (ref[:-1] > expected.unsqueeze(1) + TOL).sum(dim=1) + 1
    high = (ref[:-1] > expected.unsqueeze(1) - TOL).sum(dim=1) + 1
    ranks = torch.tensor(out.prompt_ranks)
    assert len(out.prompt_ranks) == len(prompt) - 1 and bool(((low <= ranks) & (ranks <= high)).all())
    if not k:
        assert out.prompt_top_logprobs == []
        return
    assert len(out.prompt_top_logprobs) == len(prompt) - 1
    kth = torch.topk(ref[:-1], k).values[:, -1]
    for pos, top in enumerate(out.prompt_top_logprobs):
        values = [lp for _, lp in top]
        assert len(top) == k and values == sorted(values, reverse=True)  # most likely first
        for token, lp in top:  # each is the token's own value, and among the k most likely
            assert abs(lp - ref[pos, token].item()) < TOL and lp >= kth[pos].item() - TOL
        if prompt[pos + 1] in dict(top):  # the prompt token listed with its own value
            assert abs(dict(top)[prompt[pos + 1]] - out.prompt_logprobs[pos]) < TOL


def test_prompt_logprobs_match_transformers_across_chunks(tiny_model, reference):
    engine = engine_for(tiny_model, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=5)
    first = engine.generate([PROMPT], params)[0]
    assert_matches(first, PROMPT, reference, 5)
    # Cached now: a second identical request recomputes every position (no cached blocks read)
    # and gets the same values; one without prompt logprobs still hits the cache.
    again = engine.generate([PROMPT], params)[0]
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.prompt_top_logprobs == first.prompt_top_logprobs
    assert again.prompt_ranks == first.prompt_ranks
    assert again.token_ids == first.token_ids
    plain = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert plain.num_cached_tokens == 64 and plain.prompt_logprobs == [] and plain.token_ids == first.token_ids
    assert_baseline(engine)


def test_mixed_batch_and_top_counts(tiny_model, reference):
    engine = engine_for(tiny_model, max_num_batched_tokens=40)
    prompts = [PROMPT[:45], PROMPT[10:60], PROMPT[:33], [PROMPT[3]]]
    ks = [3, None, 0, 2]
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in ks]
    outs = engine.generate(prompts, params)
    for out, prompt, k in zip(outs, prompts, ks):
        if k is None:
            assert out.prompt_logprobs == [] and out.prompt_top_logprobs == []
        else:
            assert_matches(out, prompt, reference, k)
    assert_baseline(engine)


def test_preempted_prefill_keeps_every_position_once(tiny_model, reference):
    # 6 blocks: the second prompt cannot grow past its first chunks while the first decodes, so
    # it is preempted mid-prefill (with some positions recorded) and recomputed from its start.
    engine = engine_for(tiny_model, num_kv_blocks=6, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    prompts = [PROMPT[:60], PROMPT[5:65]]
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert_matches(out, prompt, reference, 1)
    assert_baseline(engine)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_prompt_logprobs_is_checked(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
