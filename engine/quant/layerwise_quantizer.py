"""Quantize a model's matmul weights while its checkpoint streams in, one weight at a time.

The model is built with its matmul weights on the meta device (no memory). The first slice of a
fused weight (q of qkv, gate of gate_up, ...) allocates that one weight in full precision; when
its last slice has arrived it is quantized and the full-precision copy dropped. Checkpoints list
a layer's tensors together, so at most a layer's worth of full-precision weights is alive at any
moment, never the whole model (vLLM and SGLang both had to fix out-of-memory failures here).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.quant.prequantized_weights import QuantizedParts
from splitserve.engine.quant.quantize import from_parts, quantize_weight


class LayerwiseQuantizer:
    """Owns the meta placeholders of the matmul weights of `layers` until each is quantized."""

    def __init__(self, layers: list[nn.Module], attrs: tuple[str, ...], scheme: str, dtype: torch.dtype, device):
        self.scheme = scheme
        self.dtype = dtype
        self.device = torch.device(device)
        # id(meta placeholder) -> (layer, attribute name); a module lacking one of attrs (a
        # mixture-of-experts layer's dense MLP weights: its experts hold theirs) is skipped.
        self._owners = {id(getattr(layer, a)): (layer, a) for layer in layers for a in attrs if hasattr(layer, a)}
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (full-precision buffer, rows filled)
        self.peak_full_precision_bytes = 0  # the most full-precision matmul bytes alive at once

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._owners

    def load_slice(self, placeholder: torch.Tensor, first_row: int, tensor: torch.Tensor | QuantizedParts) -> None:
        key = id(placeholder)
        if isinstance(tensor, QuantizedParts):
            self._load_parts(key, placeholder, first_row, tensor)
            return
        buffer, filled = self._pending.get(key, (None, 0))
        if isinstance(buffer, list):
            raise ValueError("a fused weight mixes full-precision and pre-quantized slices")
        if buffer is None:
            buffer = torch.empty(placeholder.shape, dtype=self.dtype, device=self.device)
        buffer[first_row : first_row + tensor.shape[0]].copy_(tensor)
        filled += tensor.shape[0]
        self._pending[key] = (buffer, filled)
        alive = sum(b.numel() * b.element_size() for b, _ in self._pending.values() if isinstance(b, torch.Tensor))
        self.peak_full_precision_bytes = max(self.peak_full_precision_bytes, alive)
        if filled == placeholder.shape[0]:
            layer, attr = self._owners.pop(key)
            del self._pending[key]
            delattr(layer, attr)  # a registered Parameter cannot be overwritten by a module
            setattr(layer, attr, quantize_weight(buffer, self.scheme))

    def _load_parts(self, key: int, placeholder: torch.Tensor, first_row: int, parts: QuantizedParts) -> None:
        """A pre-quantized slice: kept as is; the fused weight is built from its slices in row order."""
        slices, filled = self._pending.get(key, ([], 0))
        if not isinstance(slices, list):
            raise ValueError("a fused weight mixes full-precision and pre-quantized slices")
        slices.append((first_row, parts))
        filled += parts.shape[0]
        self._pending[key] = (slices, filled)
        if filled == placeholder.shape[0]:
            layer, attr = self._owners.pop(key)
            del self._pending[key]
            merged = QuantizedParts.concat([p for _, p in sorted(slices, key=lambda s: s[0])])
            delattr(layer, attr)
            setattr(layer, attr, from_parts(merged.to(self.device), self.scheme))
