"""Multi-LoRA in the engine (engine/lora/): adapters written by peft on a transformers
checkpoint give transformers + peft's greedy tokens, alone and mixed with other adapters and
the base model in one batch (each layout of the delta: test_lora_layouts.py); no prefix-cache
block is shared across adapters or with the base; adapters the engine cannot serve are refused
in one line at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_runner import ModelRunner
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.handoff import finish_all, hand_off
from tests.helpers.peft_adapters import (
    FOUR_ADAPTERS,
    lora_engine,
    peft_greedy,
    write_base_and_adapters,
    write_peft_adapter,
)
from tests.helpers.transformers_checkpoint import SERVABLE_SHAPE, write_transformers_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ADAPTERS = FOUR_ADAPTERS
MAX_TOKENS = 8
PROMPTS = [[5 + (7 * i + j) % 500 for j in range(20 + 9 * i)] for i in range(len(ADAPTERS) + 1)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    return write_base_and_adapters(root, transformers.LlamaConfig(**SERVABLE_SHAPE), 11, ADAPTERS)


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[str | None, list[list[int]]]:
    """transformers + peft's greedy tokens per adapter (None: the base) for every prompt."""
    base, adapters = checkpoint
    named: dict[str | None, Path | None] = {None: None, **adapters}
    return {name: [peft_greedy(base, path, p, MAX_TOKENS) for p in PROMPTS] for name, path in named.items()}


def greedy(adapter: str | None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora_adapter=adapter)


def assert_baseline(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks


def test_each_adapter_alone_gives_transformers_peft_greedy_tokens(checkpoint, expected):
    engine = lora_engine(checkpoint)
    for name in [None, *ADAPTERS]:
        for prompt, want in zip(PROMPTS, expected[name]):
            assert engine.generate([prompt], greedy(name))[0].token_ids == want, name
    # The adapters change the output: the parity above is not the base's tokens compared with themselves.
    assert all(expected[name] != expected[None] for name in ADAPTERS)
    assert_baseline(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_mixed_batch_of_four_adapters_and_the_base_equals_each_solo_run(
    checkpoint, expected, monkeypatch, async_scheduling
):
    """Every request of the batch in the same steps (prefill chunks, then decode), each with
    its own adapter; each gets exactly its solo tokens."""
    step_adapters: list[set[str | None]] = []
    prepare = ModelRunner.prepare

    def recording(self, batch):
        step_adapters.append({seq.params.lora_adapter for seq in batch.seqs})
        return prepare(self, batch)

    monkeypatch.setattr(ModelRunner, "prepare", recording)
    # A small token budget: the prompts prefill in chunks, mixed with other requests' decodes.
    engine = lora_engine(checkpoint, async_scheduling=async_scheduling, max_num_batched_tokens=32)
    names: list[str | None] = [None, *ADAPTERS]
    outputs = engine.generate(PROMPTS, [greedy(name) for name in names])
    for name, prompt_index, out in zip(names, range(len(PROMPTS)), outputs):
        assert out.token_ids == expected[name][prompt_index], name
    # One batch really mixed the base and every adapter (no step ran one adapter alone).
    assert any(adapters == set(names) for adapters in step_adapters)
    assert_baseline(engine)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_a_quantized_base_takes_lora_on_top(checkpoint, quantization):
    """The delta is added to the quantized matmul's output in the model's dtype: each adapter
    changes the quantized base's tokens, and a mixed batch gives each request its solo tokens."""
    engine = lora_engine(checkpoint, quantization=quantization, max_num_batched_tokens=32)
    names: list[str | None] = [None, *ADAPTERS]
    solo = [engine.generate([prompt], greedy(name))[0].token_ids for name, prompt in zip(names, PROMPTS)]
    mixed = [out.token_ids for out in engine.generate(PROMPTS, [greedy(name) for name in names])]
    assert mixed == solo
    base_tokens = [engine.generate([PROMPTS[i]], greedy(None))[0].token_ids for i in range(1, len(PROMPTS))]
    assert all(adapter != base for adapter, base in zip(solo[1:], base_tokens))
    assert_baseline(engine)


def test_a_prefill_to_decode_handoff_keeps_each_requests_adapter(checkpoint, expected):
    """Disaggregated by hand: a prefill-only engine and a decode engine, the KV copied; the
    adapter rides in SamplingParams to both, and decode runs the five requests in one batch."""
    prefill, decode = lora_engine(checkpoint), lora_engine(checkpoint)
    names: list[str | None] = [None, *ADAPTERS]
    outputs = {}
    for i, (name, prompt) in enumerate(zip(names, PROMPTS)):
        first, _ = hand_off(prefill, decode, prompt, greedy(name), f"r{i}")
        outputs[f"r{i}"] = [first]
    finish_all(decode, outputs)
    for i, name in enumerate(names):
        assert outputs[f"r{i}"][-1].token_ids == expected[name][i], name
    assert_baseline(prefill)
    assert_baseline(decode)


def test_no_prefix_cache_block_is_shared_across_adapters_or_with_the_base(checkpoint, expected):
    engine = lora_engine(checkpoint)
    prompt = PROMPTS[-1]  # 56 tokens: three full blocks of 16
    first = engine.generate([prompt], greedy("attn"))[0]
    assert first.num_cached_tokens == 0
    for other in (None, "mlp", "qv"):  # the same tokens, another adapter or the base: no credit
        out = engine.generate([prompt], greedy(other))[0]
        assert out.num_cached_tokens == 0, other
        assert out.token_ids == expected[other][-1], other
    again = engine.generate([prompt], greedy("attn"))[0]  # the same adapter: its blocks are reused
    assert again.num_cached_tokens == 48
    assert again.token_ids == first.token_ids == expected["attn"][-1]
    assert_baseline(engine)


def test_a_request_for_an_adapter_not_served_is_refused(checkpoint):
    engine = lora_engine(checkpoint)
    with pytest.raises(InvalidRequestError, match=r"unknown LoRA adapter 'nope' \(served: all-rs, attn, mlp, qv\)"):
        engine.add_request(prompt_token_ids=[3, 4, 5], params=greedy("nope"))
    base, _ = checkpoint
    plain = LLMEngine(EngineConfig(model=str(base), num_kv_blocks=16))
    with pytest.raises(InvalidRequestError, match="this engine serves no adapters"):
        plain.add_request(prompt_token_ids=[3, 4, 5], params=greedy("attn"))
    assert_baseline(engine)
    assert_baseline(plain)


def _copy_adapter(src: Path, dst: Path, config_change: dict | None = None) -> Path:
    dst.mkdir()
    raw = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**raw, **(config_change or {})}))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_adapters_the_engine_cannot_serve_are_refused_in_one_line_at_load(checkpoint, tmp_path):
    base, adapters = checkpoint
    other_base = tmp_path / "other-base"  # another shape: hidden 32
    write_transformers_checkpoint(
        transformers.LlamaConfig(**{**SERVABLE_SHAPE, "hidden_size": 32}), other_base, seed=2, tokenizer=True
    )
    foreign = write_peft_adapter(other_base, tmp_path / "foreign", 5, 4, 8, ["q_proj"])
    no_weights = _copy_adapter(adapters["qv"], tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    cases = {
        "another base": (foreign, r"q_proj\.lora_A\.weight has shape \(4, 32\), the base model implies \(4, 64\)"),
        "rank": (adapters["all-rs"], "rank 16 is above max_lora_rank=8"),
        "target": (
            _copy_adapter(adapters["qv"], tmp_path / "embed", {"target_modules": ["q_proj", "embed_tokens"]}),
            "unknown target modules embed_tokens",
        ),
        "directory": (tmp_path / "missing", "missing is not a directory"),
        "config file": (no_weights.parent, "no adapter_config.json in"),
        "weights file": (no_weights, "no adapter_model.safetensors in"),
        "dora": (_copy_adapter(adapters["qv"], tmp_path / "dora", {"use_dora": True}), "DoRA is not supported"),
    }
    for case, (path, message) in cases.items():
        with pytest.raises(ConfigError, match=message) as refused:
            lora_engine(checkpoint, lora_modules={"bad": str(path)}, max_lora_rank=8)
        assert "\n" not in str(refused.value) and str(refused.value).startswith("LoRA adapter 'bad': "), case


def test_lora_settings_the_engine_cannot_serve_are_refused(checkpoint):
    base, adapters = checkpoint
    modules = {name: str(path) for name, path in adapters.items()}
    with pytest.raises(ConfigError, match="max_cpu_loras must be an integer >= max_loras=2, got 1"):
        EngineConfig(model=str(base), enable_lora=True, lora_modules=modules, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="lora_modules needs enable_lora"):
        EngineConfig(model=str(base), lora_modules=modules)
    with pytest.raises(ConfigError, match="max_lora_rank must be an integer >= 1, got 0"):
        EngineConfig(model=str(base), enable_lora=True, max_lora_rank=0)
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 is not supported yet"):
        EngineConfig(model=str(base), enable_lora=True, tensor_parallel_size=2)
