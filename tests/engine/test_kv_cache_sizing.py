"""KV sized by memory: bytes per block per KV dtype (scales included), the blocks a budget
buys (fp8 ~2x a 16-bit cache's), size strings, and budgets too small for one sequence."""

from __future__ import annotations

import pytest

from splitserve.engine.config import ConfigError, EngineConfig, parse_memory_bytes
from splitserve.engine.kv_cache_sizing import kv_bytes_per_block, num_kv_blocks_for_memory
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig

SMALL = ModelConfig("LlamaForCausalLM", 2048, 256, 768, 4, 4, 2, 64, 4096)  # the `small` preset's shape


@pytest.mark.parametrize(
    "text, expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("4K", 4000),
        ("4Ki", 4096),
        ("512Mi", 512 * 2**20),
        ("2G", 2 * 10**9),
        ("1.5Gi", 3 * 2**29),
        ("1GiB", 2**30),
        (" 3 mi ", 3 * 2**20),
    ],
)
def test_memory_sizes(text, expected):
    assert parse_memory_bytes(text) == expected


@pytest.mark.parametrize("bad", ["-1", "0", "lots", "4Gx", "", "1e9", -5, 0, True])
def test_bad_memory_sizes_are_config_errors(bad):
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be"):
        parse_memory_bytes(bad)
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be"):
        EngineConfig(model="-", kv_cache_memory_bytes=bad)


def test_same_bytes_give_fp8_about_twice_the_blocks_of_16_bit():
    budget = "1Gi"
    blocks = {
        (kv, dtype): num_kv_blocks_for_memory(SMALL, 16, kv, dtype, budget, 4096)
        for kv, dtype in (("auto", "bfloat16"), ("auto", "float32"), ("fp8", "bfloat16"), ("int8", "float32"))
    }
    # head_dim 64: a 16-bit row is 128 bytes, an 8-bit one 64 + a 2-byte scale.
    assert kv_bytes_per_block(SMALL, 16, "auto", "bfloat16") == 4 * 2 * 16 * 2 * 128
    assert kv_bytes_per_block(SMALL, 16, "fp8", None) == 4 * 2 * 16 * 2 * 66
    assert blocks[("fp8", "bfloat16")] == 2**30 // (4 * 2 * 16 * 2 * 66)
    assert 1.9 < blocks[("fp8", "bfloat16")] / blocks[("auto", "bfloat16")] <= 2
    assert 3.8 < blocks[("int8", "float32")] / blocks[("auto", "float32")] <= 4


def test_a_budget_below_one_sequence_names_what_it_needs():
    per_block = kv_bytes_per_block(SMALL, 16, "fp8", None)
    assert num_kv_blocks_for_memory(SMALL, 16, "fp8", None, 256 * per_block, 4096) == 256
    with pytest.raises(ConfigError, match=f"one 4096-token sequence needs 256 blocks, i.e. at least {256 * per_block}"):
        num_kv_blocks_for_memory(SMALL, 16, "fp8", None, 256 * per_block - 1, 4096)


def test_engine_sizes_its_cache_from_memory_and_reports_it(tiny_model):
    model = ModelConfig.from_pretrained(tiny_model)
    per_block = kv_bytes_per_block(model, 16, "fp8", None)
    engine = LLMEngine(EngineConfig(model=tiny_model, kv_cache_dtype="fp8", kv_cache_memory_bytes=100 * per_block + 7))
    assert engine.config.num_kv_blocks == engine.kv_cache.num_blocks == engine.kv.pool.num_blocks == 100
    assert engine.kv_cache.bytes_per_block == per_block
    stats = engine.stats()
    assert (stats.num_blocks, stats.kv_block_bytes, stats.kv_cache_dtype) == (100, per_block, "fp8")
    out = engine.generate([[5, 6, 7]], None)[0]
    assert out.token_ids and engine.kv.num_free_blocks == 100
    with pytest.raises(ConfigError, match="holds 1 KV blocks"):
        LLMEngine(EngineConfig(model=tiny_model, kv_cache_dtype="fp8", kv_cache_memory_bytes=per_block))
