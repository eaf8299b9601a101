"""Each quantization scheme's matmul against a dequantized reference, and its error bounds."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.quant.fp8_weight import FP8_DTYPE, Fp8Weight, quantize_per_token
from splitserve.engine.quant.int4_weight import Int4Weight, group_size_for
from splitserve.engine.quant.int8_weight import PACKED_MM_MAX_ROWS, Int8Weight
from splitserve.engine.quant.quantize import linear, quantize_weight

SHAPES = [(384, 256), (256, 768), (128, 64)]  # [out, in]: qkv/gate_up/down of small, a tiny layer
# Both int8 paths and int4 run their activations in bf16 on CPU (the only vectorised kernels):
# against an fp32 matmul on the same dequantized weights that is bf16 rounding, ~2^-8 relative.
BF16_TOLERANCE = 1.5e-2


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, PACKED_MM_MAX_ROWS + 1])  # the packed kernel and the dequantize+GEMM path
def test_int8_matmul_matches_its_dequantized_weight(shape, rows):
    weight = torch.randn(shape)
    qweight = Int8Weight.quantize(weight)
    assert qweight.qweight.dtype == torch.int8 and qweight.scale.shape == (shape[0],)
    # Per channel symmetric: every weight within half a step of its channel's scale.
    assert bool(((qweight.dequantize() - weight).abs() <= qweight.scale[:, None] / 2 + 1e-6).all())
    x = torch.randn(rows, shape[1])
    assert _relative_error(qweight(x), x @ qweight.dequantize().t()) < BF16_TOLERANCE


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_matmul_matches_its_dequantized_weight(shape):
    weight = torch.randn(shape)
    qweight = Int4Weight.quantize(weight)
    group = group_size_for(shape[1])
    assert qweight.group_size == group == (128 if shape[1] % 128 == 0 else 64)
    # An independent dequantization from the same min/max grid: q*scale + min per group.
    w = weight.reshape(shape[0], -1, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    reference = (torch.round((w - lo) / step).clamp(0, 15) * step + lo).reshape(shape)
    # bf16 scales and zeros: within a small fraction of a quantization step.
    assert float((qweight.dequantize() - reference).abs().max()) < 0.05 * float(step.max())
    for rows in (1, 33):
        x = torch.randn(rows, shape[1])
        assert _relative_error(qweight(x), x @ reference.t()) < BF16_TOLERANCE
    assert qweight.packed.numel() * qweight.packed.element_size() == shape[0] * shape[1] // 2
    # The other devices' layout (two nibbles a byte, dequantized per call) holds the same weight.
    nibbles = Int4Weight.quantize(weight, cpu_kernel=False)
    assert nibbles.packed.shape == (shape[0], shape[1] // 2) and nibbles.packed.dtype == torch.uint8
    # (the CPU layout reads back through the kernel, in bf16: 2^-8 relative)
    torch.testing.assert_close(nibbles.dequantize(), qweight.dequantize(), rtol=4e-3, atol=1e-6)
    x = torch.randn(5, shape[1])
    assert _relative_error(nibbles(x), x @ reference.t()) < 1e-2  # bf16 scales only: fp32 activations


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_fp8_matmul_matches_fake_quantized_reference_and_scaled_mm(shape, rows):
    weight = torch.randn(shape)
    qweight = Fp8Weight.quantize(weight)
    assert qweight.qweight.dtype == FP8_DTYPE
    x = torch.randn(rows, shape[1])
    xq, x_scale = quantize_per_token(x)
    # W8A8: both operands rounded to e4m3, products accumulated in fp32.
    reference = (xq.float() * x_scale) @ qweight.dequantize().t()
    out = qweight(x)  # CPU: the emulated path (no fp8 hardware)
    assert _relative_error(out, reference) < 1e-5
    # torch._scaled_mm (emulated on CPU, native on Hopper) computes the same thing; bf16 output.
    assert _relative_error(qweight.scaled_mm(x), reference) < BF16_TOLERANCE
    # e4m3 has 3 mantissa bits: a W8A8 product is within a few percent of full precision.
    assert _relative_error(out, x @ weight.t()) < 0.08


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_linear_adds_the_float_bias_and_keeps_the_activation_dtype(scheme):
    weight, bias, x = torch.randn(128, 256), torch.randn(128), torch.randn(3, 256)
    qweight = quantize_weight(weight, scheme)
    out = linear(x, qweight, bias)
    assert out.dtype == torch.float32 and out.shape == (3, 128)
    torch.testing.assert_close(out - bias, linear(x, qweight), rtol=0, atol=1e-5)


def test_an_unknown_scheme_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown quantization 'int3'; choose none, int8, fp8, int4"):
        quantize_weight(torch.randn(4, 32), "int3")
