"""gpu_check check 6: fp8 KV attention -- the Triton decode kernel reading an fp8 (e4m3) cache
with float16 scales per (token, head), against the bf16 kernel on the same K/V.

Correctness: the fp8 kernel within 1e-2 of fp32 attention over the dequantized cache (its own
error) and within the stated fp8 tolerance of the bf16 kernel (the quantization's). Speed: the
fp8 kernel's time vs the bf16 kernel's at batch 1, 32, 64 and 256, and K/V bytes read per second
(it reads ~half the bytes; on a GPU decode attention is bandwidth-bound, so it should not be slower).
"""

from __future__ import annotations

import functools

import torch

from splitserve.bench.gpu_check.gpu_check_ops import HEAD_DIM, item, paged_problem, time_ms

KERNEL_TOLERANCE = 1e-2  # vs fp32 attention over the dequantized cache (bf16/fp16 queries)
FP8_TOLERANCE = 0.15  # vs the 16-bit kernel on N(0, 1) K/V (tests/helpers/quantized_kv_cases.py)


def _fp8_cache(cache: torch.Tensor):
    from splitserve.engine.ops.quantized_kv import quantize

    values, scales = quantize(cache, torch.float8_e4m3fn)
    return values, scales


def _cases(tiny: bool) -> list[tuple[int, int, torch.dtype]]:
    if tiny:  # fp16 queries: the interpreter's bf16 tl.dot is wrong (Triton 3.9)
        return [(1, 40, torch.float16), (3, 33, torch.float16)]
    return [
        (1, 32768, torch.bfloat16),
        (32, 4096, torch.bfloat16),
        (64, 4096, torch.bfloat16),
        (256, 2048, torch.bfloat16),
    ]


def check_fp8_kv(device: torch.device, tiny: bool) -> dict:
    from splitserve.engine.ops import attention
    from splitserve.engine.ops import triton_decode_attention as kernels
    from splitserve.engine.ops.quantized_kv import QuantizedKV, dequantize

    timing = {"reps": 1, "warmup": 0} if tiny else {"reps": 20, "warmup": 3}
    items = []
    for index, (batch, context, dtype) in enumerate(_cases(tiny)):
        q, key_cache, value_cache, tables, lens = paged_problem([context] * batch, dtype, device, seed=200 + index)
        k_values, k_scales = _fp8_cache(key_cache)
        v_values, v_scales = _fp8_cache(value_cache)
        scale = HEAD_DIM**-0.5
        fp8_out, bf16_out = torch.empty_like(q), torch.empty_like(q)
        fp8_kernel = functools.partial(
            kernels.paged_decode_attention,
            *(q, k_values, v_values, tables, lens, scale, fp8_out),
            key_scales=k_scales,
            value_scales=v_scales,
        )
        bf16_kernel = functools.partial(
            kernels.paged_decode_attention, q, key_cache, value_cache, tables, lens, scale, bf16_out
        )

        fp8_kernel()
        bf16_kernel()
        dequantized = attention.paged_decode_attention_torch(
            q.float(),
            dequantize(k_values, k_scales, torch.float32),
            dequantize(v_values, v_scales, torch.float32),
            tables,
            lens,
            scale,
            context,
        )
        kernel_error = (fp8_out.float() - dequantized).abs().max().item()
        fp8_error = (fp8_out.float() - bf16_out.float()).abs().max().item()
        dispatched = attention.decode_attention(
            q, QuantizedKV(k_values, k_scales), QuantizedKV(v_values, v_scales), tables, lens, scale, context
        )
        same_path = torch.equal(dispatched, fp8_out) or device.type == "cpu"
        ok = kernel_error <= KERNEL_TOLERANCE and fp8_error <= FP8_TOLERANCE and same_path
        items.append(
            item(
                f"fp8 KV attention b={batch} ctx={context}",
                "pass" if ok else "fail",
                "decode_attention dispatches a QuantizedKV to it" if same_path else "decode_attention differs",
                max_abs_error_vs_dequantized=kernel_error,
                max_abs_error_vs_bf16_kernel=fp8_error,
                tolerance=FP8_TOLERANCE,
            )
        )
        fp8_ms, bf16_ms = time_ms(fp8_kernel, device, **timing), time_ms(bf16_kernel, device, **timing)
        fp8_bytes = k_values.numel() * 2 + k_scales.numel() * 4  # K and V values + their float16 scales
        items.append(
            item(
                f"fp8 KV attention speed b={batch} ctx={context}",
                "info",
                "fp8 / bf16 kernel time",
                fp8_ms=fp8_ms,
                bf16_ms=bf16_ms,
                fp8_over_bf16=fp8_ms / bf16_ms,
                fp8_kv_gb_per_s=fp8_bytes / (fp8_ms / 1e3) / 1e9,
                bf16_kv_gb_per_s=2 * key_cache.nbytes / (bf16_ms / 1e3) / 1e9,
            )
        )
    return {"items": items}
