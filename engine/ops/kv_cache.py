"""The paged KV cache: one preallocated tensor of fixed-size blocks for all layers."""

from __future__ import annotations

import torch

from splitserve.engine.config import DTYPES, EngineConfig, ModelConfig

DTYPE_BY_NAME = {name: getattr(torch, name) for name in DTYPES}


class KVCache:
    """kv[layer, 0|1 (K|V), block, offset_in_block, kv_head, head_dim].

    Layer-major so that one layer's K and V for any set of blocks can be packed and sent
    as soon as that layer's forward pass finishes (layer-wise KV transfer).
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig):
        dtype = DTYPE_BY_NAME[engine_config.dtype or model_config.dtype]
        self.num_layers = model_config.num_hidden_layers
        self.num_blocks = engine_config.num_kv_blocks
        self.block_size = engine_config.block_size
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self.kv = torch.zeros(
            self.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype=dtype,
            device=engine_config.device,
        )

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def layer_planes(self, layer: int) -> torch.Tensor:
        """[2, num_blocks, block_numel] view of one layer, for block gather/scatter."""
        return self.kv[layer].view(2, self.num_blocks, -1)

    @property
    def bytes_per_block_per_layer(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_block_per_layer
