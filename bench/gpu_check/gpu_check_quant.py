"""gpu_check check 6: the quantized matmuls (engine/quant) on the device, against bf16 (int4 too:
on a GPU its nibbles are dequantized per call, a correctness check of that path).

For fp8 (W8A8: e4m3 weights per channel, per-token dynamic activation scales; torch._scaled_mm
where the device has fp8, i.e. Hopper/Ada) and int8 (weight-only, per channel) at a
4096x4096 layer (256x256 with --tiny) and batch 1, 64 and 256: the engine's matmul vs bf16
F.linear on the original weights (error within the scheme's tolerance) and vs the dequantized
weights (the kernel computes what the scheme says); then milliseconds next to bf16. On a GPU
two int8 alternatives are timed too, to choose from on the next change: torch's
_weight_int8pack_mm and a W8A8 int8 GEMM (torch._int_mm with per-token activation scales).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.bench.gpu_check.gpu_check_ops import item, time_ms
from splitserve.engine.quant.fp8_weight import Fp8Weight, fp8_hardware, quantize_per_token
from splitserve.engine.quant.int4_weight import Int4Weight
from splitserve.engine.quant.int8_weight import Int8Weight

BATCHES = (1, 64, 256)
# Relative error (max abs / max abs of the reference) of each scheme vs bf16 on the original
# weights: e4m3 keeps 3 mantissa bits on both operands; int8 weights 7 bits, bf16 activations.
TOLERANCE_VS_BF16 = {"fp8": 0.08, "int8": 0.03, "int4": 0.3}
TOLERANCE_VS_DEQUANTIZED = 0.02  # bf16 output rounding and accumulation order


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _int8_w8a8(x: torch.Tensor, q_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """int8 x int8 -> int32 (torch._int_mm, CUDA) with per-token activation scales."""
    x_scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 127
    xq = torch.round(x.float() / x_scale).clamp_(-127, 127).to(torch.int8)
    return (torch._int_mm(xq, q_t).float() * x_scale * w_scale).to(x.dtype)


def check_quant(device: torch.device, tiny: bool) -> dict:
    size = 256 if tiny else 4096
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(size, size, generator=gen) * 0.02).to(device, torch.bfloat16)
    schemes = {
        "fp8": Fp8Weight.quantize(weight),
        "int8": Int8Weight.quantize(weight),
        "int4": Int4Weight.quantize(weight),
    }
    items = [
        item(
            "fp8 path",
            "info",
            "torch._scaled_mm (native fp8)"
            if fp8_hardware(device)
            else "emulated: weights converted per call (no fp8 hardware)",
        )
    ]
    for batch in BATCHES:
        x = torch.randn(max(batch, 1), size, generator=gen).to(device, torch.bfloat16)
        bf16 = F.linear(x, weight)
        bf16_ms = time_ms(lambda x=x: F.linear(x, weight), device)
        items.append(item(f"bf16 batch {batch}", "info", ms=bf16_ms))
        for name, qweight in schemes.items():
            out = qweight(x)
            if name == "fp8":
                xq, x_scale = quantize_per_token(x)
                reference = F.linear((xq.float() * x_scale), qweight.dequantize())
            else:
                reference = F.linear(x.float(), qweight.dequantize())
            vs_bf16, vs_deq = _relative(out, bf16), _relative(out, reference)
            ok = vs_bf16 <= TOLERANCE_VS_BF16[name] and vs_deq <= TOLERANCE_VS_DEQUANTIZED
            ms = time_ms(lambda x=x, q=qweight: q(x), device)
            items.append(
                item(
                    f"{name} batch {batch}",
                    "pass" if ok else "fail",
                    f"vs bf16 <= {TOLERANCE_VS_BF16[name]}, vs dequantized <= {TOLERANCE_VS_DEQUANTIZED}",
                    err_vs_bf16=vs_bf16,
                    err_vs_dequantized=vs_deq,
                    ms=ms,
                    speedup_vs_bf16=bf16_ms / ms,
                )
            )
        if device.type == "cuda":
            items += _int8_alternatives(x, schemes["int8"], bf16, bf16_ms, batch, device)
    return {"items": items}


def _int8_alternatives(x, qweight: Int8Weight, bf16, bf16_ms: float, batch: int, device) -> list[dict]:
    """Other int8 GEMMs torch ships for CUDA, timed for the record (info; failures noted, not fatal)."""
    found = []
    q_t = qweight.qweight.t().contiguous().t()  # column-major int8 for _int_mm
    candidates = {
        "int8 _weight_int8pack_mm": lambda: torch.ops.aten._weight_int8pack_mm(x, qweight.qweight, qweight.scale_bf16),
        "int8 W8A8 _int_mm": lambda: _int8_w8a8(x, q_t, qweight.scale),
    }
    for name, fn in candidates.items():
        try:
            err = _relative(fn(), bf16)
            ms = time_ms(fn, device)
            found.append(item(f"{name} batch {batch}", "info", err_vs_bf16=err, ms=ms, speedup_vs_bf16=bf16_ms / ms))
        except (RuntimeError, NotImplementedError) as exc:
            found.append(item(f"{name} batch {batch}", "info", f"not available: {str(exc).splitlines()[0][:160]}"))
    return found
