"""fp8 (e4m3) weights with per-output-channel scales, and dynamic per-token activation scales (W8A8)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def fp8_hardware(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs natively here: CUDA with compute capability >= 8.9
    (Ada, Hopper). On CPU it exists but is emulated, and measured slower than the fallback."""
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    # Asked once per device: every fp8 matmul asks, and a query per call is host time on a step
    # the H200 already found host-bound (bench/results/gpu_check.md).
    return torch.cuda.get_device_capability(index)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (fp8 [T, K], float32 scale [T, 1]) with x ~= q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8Weight(nn.Module):
    """W [out, in] stored as e4m3 q with w ~= q * scale[:, None]."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())

    @staticmethod
    def quantize_values(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q e4m3 [out, in], scale [out]): what quantize() holds."""
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        return cls(*cls.quantize_values(weight))

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The W8A8 GEMM: fp8 x fp8 with a row-wise activation and column-wise weight scale."""
        xq, x_scale = quantize_per_token(x)
        out = torch._scaled_mm(
            xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scale[None, :], out_dtype=torch.bfloat16
        )
        return out.to(x.dtype)

    def emulated_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic without fp8 hardware: activations rounded to fp8 per token (so
        the result is what scaled_mm computes), weights converted to x's dtype for one GEMM."""
        xq, x_scale = quantize_per_token(x)
        xd = (xq.to(torch.float32) * x_scale).to(x.dtype)
        return F.linear(xd, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.qweight.shape[1], self.qweight.shape[0]
        if fp8_hardware(x.device) and k % 16 == 0 and n % 16 == 0:
            return self.scaled_mm(x)
        return self.emulated_mm(x)
