"""The paged KV cache: one preallocated tensor of fixed-size blocks for all layers."""

from __future__ import annotations

import torch

from splitserve.engine.config import DTYPES, EngineConfig
from splitserve.engine.kv_cache_sizing import SCALE_BYTES
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.quantized_kv import SCALE_DTYPE, STORAGE_DTYPES, QuantizedKV

DTYPE_BY_NAME = {name: getattr(torch, name) for name in DTYPES}


class KVCache:
    """kv[layer, 0|1 (K|V), block, offset_in_block, kv_head, head_dim].

    Layer-major so that one layer's K and V for any set of blocks can be packed and sent
    as soon as that layer's forward pass finishes (layer-wise KV transfer).

    A quantized cache (kv_cache_dtype fp8/int8) is kv[layer, 0|1, block, row_bytes] uint8:
    each block's row holds its 8-bit values [block_size, kv_head, head_dim] then their float16
    scales [block_size, kv_head], so a block's bytes (and a transfer of them) carry its scales.
    key_cache/value_cache then return a QuantizedKV of views into those rows.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig):
        self.model_dtype = DTYPE_BY_NAME[engine_config.dtype or model_config.dtype]
        self.kv_cache_dtype = engine_config.kv_cache_dtype
        self.num_layers = model_config.num_hidden_layers
        self.num_blocks = engine_config.num_kv_blocks
        self.block_size = engine_config.block_size
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self._storage_dtype = STORAGE_DTYPES.get(self.kv_cache_dtype)
        block_dims = (self.block_size, self.num_kv_heads, self.head_dim)
        if self._storage_dtype is None:
            shape, dtype = (self.num_layers, 2, self.num_blocks, *block_dims), self.model_dtype
        else:
            self._value_bytes = self.block_size * self.num_kv_heads * self.head_dim
            row_bytes = self._value_bytes + self.block_size * self.num_kv_heads * SCALE_BYTES
            shape, dtype = (self.num_layers, 2, self.num_blocks, row_bytes), torch.uint8
        self.kv = torch.zeros(*shape, dtype=dtype, device=engine_config.device)
        self._layers = [(self._plane(layer, 0), self._plane(layer, 1)) for layer in range(self.num_layers)]

    def _plane(self, layer: int, plane: int) -> torch.Tensor | QuantizedKV:
        if self._storage_dtype is None:
            return self.kv[layer, plane]
        rows = self.kv[layer, plane]
        values = rows[:, : self._value_bytes].view(self._storage_dtype)
        scales = rows[:, self._value_bytes :].view(SCALE_DTYPE)
        return QuantizedKV(
            values.view(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim),
            scales.view(self.num_blocks, self.block_size, self.num_kv_heads),
        )

    @property
    def quantized(self) -> bool:
        return self._storage_dtype is not None

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        """The element type of the cache tensor (uint8 for a quantized cache's byte rows)."""
        return self.kv.dtype

    def key_cache(self, layer: int) -> torch.Tensor | QuantizedKV:
        return self._layers[layer][0]

    def value_cache(self, layer: int) -> torch.Tensor | QuantizedKV:
        return self._layers[layer][1]

    def layer_planes(self, layer: int) -> torch.Tensor:
        """[2, num_blocks, block_numel] view of one layer, for block gather/scatter (bytes,
        scales included, for a quantized cache)."""
        return self.kv[layer].view(2, self.num_blocks, -1)

    @property
    def bytes_per_block_per_layer(self) -> int:
        return self.kv[0, :, 0].numel() * self.kv.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_block_per_layer
