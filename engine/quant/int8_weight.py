"""int8 weight-only quantization, one symmetric scale per output channel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX = 127
# On CPU torch's _weight_int8pack_mm is only vectorised for bf16 activations (fp32: 11 ms vs
# 2.7 ms at 4096x4096, batch 1, one thread) and its cost grows with the rows; measured at
# 4096x4096 it beats converting the weight to bf16 + a bf16 GEMM up to 64 rows (177 vs 210 ms
# on a loaded box) and loses at 256 (902 vs 315 ms): decode batches take the kernel, long
# prefill chunks the conversion (bench/results/quantization.md).
PACKED_MM_MAX_ROWS = 64


class Int8Weight(nn.Module):
    """W [out, in] stored as int8 q with w ~= q * scale[:, None]; activations stay in float.

    scale may also be [out, in // group] (compressed-tensors W8A16 checkpoints): loaded as
    stored, then every call dequantizes (no torch kernel takes int8 group scales)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.grouped = scale.dim() == 2
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16).contiguous())

    @staticmethod
    def quantize_values(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [out, in], scale [out]): what quantize() holds."""
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
        return torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        return cls(*cls.quantize_values(weight))

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.grouped:
            groups = self.qweight.float().unflatten(-1, (self.scale.shape[1], -1))
            return (groups * self.scale[..., None]).flatten(-2).to(dtype)
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            return F.linear(x, self.dequantize(x.dtype))
        if x.device.type == "cpu":
            xb = x.to(torch.bfloat16)
            if x.shape[0] <= PACKED_MM_MAX_ROWS:
                out = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scale_bf16)
            else:
                out = F.linear(xb, self.qweight.to(torch.bfloat16)) * self.scale_bf16
            return out.to(x.dtype)
        return F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
