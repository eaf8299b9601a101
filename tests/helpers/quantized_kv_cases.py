"""Paged attention problems over a quantized (fp8/int8) KV cache, for the torch-path tests
(tests/engine/test_quantized_kv.py) and the Triton interpreter cases (triton_cases.py).

The cache is a real KVCache (one uint8 row of values + float16 scales per block, strided
views); its K/V are the quantized copies of a dense fp32 cache that the references use.
"""

from __future__ import annotations

import math

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.kv_cache import KVCache

# Largest |attention output - fp32 attention| allowed over a quantized cache, on N(0, 1) K/V:
# fp8 e4m3 keeps 3 mantissa bits (<= 6.25 % per value), int8 7 bits (<= 0.4 % of the row max).
# Measured maxima over 15 problems (5 seeds x 3 shapes up to head_dim 64): fp8 0.084, int8 0.0145.
ATTENTION_TOLERANCE = {"fp8": 0.15, "int8": 0.03}


def quantized_cache(num_blocks, block_size, num_q_heads, num_kv_heads, head_dim, kv_cache_dtype, num_layers=1):
    model = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=8,
        hidden_size=num_q_heads * head_dim,
        intermediate_size=8,
        num_hidden_layers=num_layers,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
    )
    config = EngineConfig(model="-", block_size=block_size, num_kv_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)
    return KVCache(model, config)


def quantized_paged_problem(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, kv_cache_dtype, seed=0):
    """(q, cache, dense_keys, dense_values, block_tables, context_lens): cache layer 0 holds
    dense_keys/dense_values [num_blocks, block_size, Hkv, D] quantized."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(length / block_size) for length in context_lens) + 1
    num_blocks = len(context_lens) * max_blocks + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(context_lens), num_q_heads, head_dim, generator=generator)
    keys = torch.randn(shape, generator=generator)
    values = torch.randn(shape, generator=generator)
    cache = quantized_cache(num_blocks, block_size, num_q_heads, num_kv_heads, head_dim, kv_cache_dtype)
    slots = torch.arange(num_blocks * block_size)
    cache.key_cache(0).write(keys.view(-1, num_kv_heads, head_dim), slots)
    cache.value_cache(0).write(values.view(-1, num_kv_heads, head_dim), slots)
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    physical = torch.randperm(num_blocks - 1, generator=generator) + 1
    cursor = 0
    for seq, length in enumerate(context_lens):
        needed = math.ceil(length / block_size)
        tables[seq, :needed] = physical[cursor : cursor + needed].int()
        cursor += needed
    return q, cache, keys, values, tables, torch.tensor(context_lens, dtype=torch.int32)


def dequantized_layer(cache: KVCache, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's K and V of one layer as dense fp32 [num_blocks, block_size, Hkv, D]."""
    ids = torch.arange(cache.num_blocks)
    return cache.key_cache(layer).gather(ids, torch.float32), cache.value_cache(layer).gather(ids, torch.float32)
