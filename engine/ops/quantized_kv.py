"""One layer's K (or V) cache stored in 8 bits, with a float16 scale per (token, kv head).

Symmetric quantization: x ~= q * scale with scale = amax(|x| over head_dim) / qmax, qmax 448
for float8_e4m3fn and 127 for int8. Writes quantize as they store; reads dequantize.

Why per (token, head) and not per (block, head): measured on the trained small model's real
activations (bench/quantization/kv_quant_granularity.py, bench/results/kv_cache_quantization.md), it has the
lower attention error -- int8 0.0104 vs 0.0128 relative, fp8 0.047 vs 0.050 (fp8's 3-bit
mantissa dominates its error, whatever the scale) -- for 2 bytes per head_dim values (3 % more
bytes at head_dim 64), and per-block's figure is its best case: a token's scale is fixed when
the token is written, so a block filled a token at a time during decode never needs
re-quantizing (per block it would, or would clip later outliers), a shared prefix block is
immutable, and an outlier token costs precision only in its own row. Scales are float16: their
11-bit mantissa is finer than either format's, and they halve float32's scale bytes.

The data and scales live in one uint8 row per block (engine/ops/kv_cache.py), so every block
copy and KV transfer moves both without knowing about them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STORAGE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
SCALE_DTYPE = torch.float16
_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
# A scale stays a positive float16 (its smallest subnormal is 6e-8); an all-zero row then
# quantizes to zeros instead of dividing by zero.
_MIN_SCALE = 1e-7


def quantize(x: torch.Tensor, storage_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in storage_dtype, scales [...] float16)."""
    qmax = _QMAX[storage_dtype]
    xf = x.float()
    scales = (xf.abs().amax(-1) / qmax).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)
    scaled = (xf / scales.float().unsqueeze(-1)).clamp(-qmax, qmax)
    if storage_dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(storage_dtype), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] (8-bit) and scales [...] -> [..., D] in dtype."""
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


@dataclass
class QuantizedKV:
    """values [num_blocks, block_size, kv_heads, head_dim] (fp8/int8) and scales
    [num_blocks, block_size, kv_heads] (float16): strided views into the cache's byte rows."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize x [T, kv_heads, head_dim] into slots slot_mapping [T]."""
        block_size = self.values.shape[1]
        slots = slot_mapping.long()
        index = (torch.div(slots, block_size, rounding_mode="floor"), slots % block_size)
        values, scales = quantize(x, self.values.dtype)
        # uint8 views: index_put_ on the raw bytes works for every 8-bit format and device.
        self.values.view(torch.uint8).index_put_(index, values.view(torch.uint8))
        self.scales.index_put_(index, scales)

    def gather(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks block_ids [n] dequantized to dtype: [n, block_size, kv_heads, head_dim]."""
        ids = block_ids.reshape(-1).long()
        values = self.values.view(torch.uint8).index_select(0, ids).view(self.values.dtype)
        return dequantize(values, self.scales.index_select(0, ids), dtype)
