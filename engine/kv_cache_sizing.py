"""Bytes per KV block for each KV-cache dtype, and the block count a memory budget buys.

Pure arithmetic on the model's shape (no torch), so the ingress (request limits), the
workers (their cache) and the benchmark all size a cache the same way.
"""

from __future__ import annotations

from splitserve.engine.config import ConfigError, parse_memory_bytes
from splitserve.engine.model_config import ModelConfig

# A quantized value is one byte; its scale is one float16 per (token, kv head)
# (engine/ops/quantized_kv.py says why per token and why float16).
QUANTIZED_VALUE_BYTES = 1
SCALE_BYTES = 2
MODEL_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, kv_cache_dtype: str, dtype: str | None) -> int:
    """K and V of one block across all layers, scales included. dtype: the model's (auto KV)."""
    tokens_heads = block_size * model_config.num_key_value_heads
    if kv_cache_dtype == "auto":
        per_token_head = model_config.head_dim * MODEL_DTYPE_BYTES[dtype or model_config.dtype]
    else:
        per_token_head = model_config.head_dim * QUANTIZED_VALUE_BYTES + SCALE_BYTES
    return model_config.num_hidden_layers * 2 * tokens_heads * per_token_head


def num_kv_blocks_for_memory(
    model_config: ModelConfig,
    block_size: int,
    kv_cache_dtype: str,
    dtype: str | None,
    memory_bytes: int | str,
    max_model_len: int,
) -> int:
    """Blocks that fit memory_bytes. A budget that cannot hold one max_model_len sequence
    (or the engine's minimum of 2 blocks) is a ConfigError naming the bytes it needs."""
    budget = parse_memory_bytes(memory_bytes)
    per_block = kv_bytes_per_block(model_config, block_size, kv_cache_dtype, dtype)
    needed = max(2, -(-max_model_len // block_size))
    blocks = budget // per_block
    if blocks < needed:
        raise ConfigError(
            f"kv_cache_memory_bytes {budget} holds {blocks} KV blocks of {per_block} bytes "
            f"(kv_cache_dtype {kv_cache_dtype}); one {max_model_len}-token sequence needs {needed} blocks, "
            f"i.e. at least {needed * per_block} bytes"
        )
    return blocks


def resolve_num_kv_blocks(
    model_config: ModelConfig,
    block_size: int,
    kv_cache_dtype: str,
    dtype: str | None,
    num_kv_blocks: int,
    memory_bytes: int | str | None,
    max_model_len: int,
) -> int:
    """The cache's block count: what memory_bytes buys when set, else num_kv_blocks."""
    if memory_bytes is None:
        return num_kv_blocks
    return num_kv_blocks_for_memory(model_config, block_size, kv_cache_dtype, dtype, memory_bytes, max_model_len)


def kv_cache_summary(
    model_config: ModelConfig,
    block_size: int,
    kv_cache_dtype: str,
    dtype: str | None,
    num_kv_blocks: int,
    memory_bytes: int | str | None,
    max_model_len: int,
) -> dict[str, int | str]:
    """What one replica's cache holds (for /health and start-up checks): its dtype, blocks,
    bytes per block and total bytes. Raises ConfigError for a budget below one sequence."""
    blocks = resolve_num_kv_blocks(
        model_config, block_size, kv_cache_dtype, dtype, num_kv_blocks, memory_bytes, max_model_len
    )
    per_block = kv_bytes_per_block(model_config, block_size, kv_cache_dtype, dtype)
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "num_blocks": blocks,
        "bytes_per_block": per_block,
        "bytes": blocks * per_block,
    }
