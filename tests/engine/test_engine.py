"""The colocated engine end to end: parity with transformers, batching, prefix caching,
preemption, sampling, stops, bad input, the `generate` CLI, and no leaked blocks."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model.loader import CheckpointError
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cli import run_cli
from tests.helpers.model import make_checkpoint

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def engine_for(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def assert_baseline(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert all(c == 0 for c in engine.kv.pool.ref_counts)
    assert not engine.scheduler.has_unfinished()


def hf_greedy(model_dir, prompt_ids: list[int], num_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        # An explicit mask: the bos id can equal the pad id, which would otherwise be masked out.
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            eos_token_id=None,
            pad_token_id=model.config.vocab_size - 1,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_matches_transformers(models_root, arch):
    model_dir = make_checkpoint(models_root, "tiny", arch)
    engine = engine_for(model_dir)
    prompts = [
        engine.tokenizer.encode("The quick brown fox jumps over the lazy dog."),
        engine.tokenizer.encode("Once upon a time"),
    ]
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, 64)
        assert out.finish_reason == "length"
    assert_baseline(engine)


def test_batch_equals_alone(tiny_model):
    engine = engine_for(tiny_model, max_num_batched_tokens=64)
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 16, 17, 40, 33)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = [o.token_ids for o in engine.generate(prompts, params)]
    alone = [engine_for(tiny_model, enable_prefix_caching=False).generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
    assert_baseline(engine)


def test_prefix_cache_hit_matches_miss_and_skips_compute(tiny_model):
    engine = engine_for(tiny_model)
    shared = list(range(10, 10 + 48))  # three full blocks
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    miss = engine.generate([shared + [200, 201, 202]], params)[0]
    computed_before = engine.scheduler.num_computed_prompt_tokens
    hit = engine.generate([shared + [200, 201, 202]], params)[0]
    assert hit.token_ids == miss.token_ids
    assert hit.num_cached_tokens == 48 and miss.num_cached_tokens == 0
    assert engine.scheduler.num_computed_prompt_tokens - computed_before == 3
    cold = engine_for(tiny_model, enable_prefix_caching=False).generate([shared + [200, 201, 202]], params)[0]
    assert cold.token_ids == miss.token_ids
    assert_baseline(engine)


def test_preemption_under_tiny_block_budget_gives_same_tokens(tiny_model):
    prompts = [list(range(5 + i, 25 + i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = engine_for(tiny_model).generate(prompts, params)
    tight = engine_for(tiny_model, num_kv_blocks=10, block_size=16)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert_baseline(tight)


def test_seeded_sampling_is_reproducible_across_batches(tiny_model):
    engine = engine_for(tiny_model)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], p)[0].token_ids
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    batched = engine.generate([[9, 9, 9, 9], [5, 6, 7]], [other, p])[1].token_ids
    assert alone == batched
    different = engine.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.9, seed=4321, max_tokens=20, ignore_eos=True)
    )[0].token_ids
    assert different != alone
    assert_baseline(engine)


def test_stop_token_stop_string_logprobs_and_max_tokens(tiny_model):
    engine = engine_for(tiny_model)
    base = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=True))[0]
    assert len(base.logprobs) == 30 and all(lp <= 0 for lp in base.logprobs)
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = engine.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])
    )[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
    text = base.text
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    if stop_str and stop_str.strip():
        cut = engine.generate(
            [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_str])
        )[0]
        assert cut.finish_reason == "stop" and stop_str not in cut.text
        assert text.startswith(cut.text)
    assert_baseline(engine)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [10**6]}, "vocabulary"),
        ({"prompt_token_ids": [1] * 5000}, "context"),
        ({"prompt_token_ids": [1, 2], "params": SamplingParams(max_tokens=5000)}, "context"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_model, kwargs, match):
    engine = engine_for(tiny_model)
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(**kwargs)
    assert_baseline(engine)


def test_bad_params_and_missing_files(tmp_path, tiny_model):
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises((CheckpointError, ConfigError)):
        engine_for(tmp_path / "nowhere")


def test_generate_cli_json(tiny_model, capsys):
    def run(*args):
        return run_cli(capsys, "generate", "--model", tiny_model, *args)

    res = run("--prompt-token-ids", "5,6,7", "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    expected = engine_for(tiny_model).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0]
    assert got["token_ids"] == expected.token_ids and got["text"] == expected.text
    bad = run("--prompt", "", "--max-tokens", "8")
    assert bad.returncode == 2 and "empty" in bad.stderr and "Traceback" not in bad.stderr
    bad = run("--prompt", "hi", "--max-tokens", "0")
    assert bad.returncode == 2 and "max_tokens" in bad.stderr
