"""Triton kernels: paged decode attention (16/32-bit or fp8/int8 KV) and KV-block gather/scatter.

Importing this module needs triton but no GPU (the kernels are only compiled when launched);
under TRITON_INTERPRET=1 they run on CPU tensors, which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.ops.triton_input_checks import (
    KernelInputError,
    check_attention_inputs,
    check_copy,
    check_scales,
)

__all__ = ["KernelInputError", "gather_blocks", "paged_decode_attention", "scatter_blocks"]

# tl.dot needs every dimension >= 16 when compiled for a GPU; smaller tiles use broadcast-sum.
_MIN_DOT_DIM = 16
_COPY_BLOCK = 1024


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    window,
    stride_qb,
    stride_qh,
    stride_kblock,
    stride_koff,
    stride_khead,
    stride_vblock,
    stride_voff,
    stride_vhead,
    stride_sblock,
    stride_soff,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    QUANT: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program = one sequence x one KV head, covering that head's GROUP query heads.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_g

    q_ptrs = q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    context_len = tl.load(context_lens_ptr + seq)
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    # A sliding window (window > 0): only the last `window` tokens, from the block holding
    # the first of them (the blocks before it may be freed already); else from token 0.
    first_token = tl.maximum(context_len - tl.where(window > 0, window, context_len), 0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    for block_index in range(first_token // BLOCK_SIZE, num_blocks):
        # int64: block * stride overflows int32 for large caches.
        block_id = tl.load(block_tables_ptr + seq * stride_bt + block_index).to(tl.int64)
        token = block_index * BLOCK_SIZE + offs_n
        mask_n = (offs_n < BLOCK_SIZE) & (token < context_len) & (token >= first_token)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = (
            k_ptr + block_id * stride_kblock + offs_n[:, None] * stride_koff + kv_head * stride_khead + offs_d[None, :]
        )
        v_ptrs = (
            v_ptr + block_id * stride_vblock + offs_n[:, None] * stride_voff + kv_head * stride_vhead + offs_d[None, :]
        )
        if QUANT:
            # 8-bit values times their per-(token, head) scale; fp8 arrives as raw bytes.
            k = tl.load(k_ptrs, mask=kv_mask, other=0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0)
            if FP8:
                k = k.to(tl.float8e4nv, bitcast=True)
                v = v.to(tl.float8e4nv, bitcast=True)
            scale_offs = block_id * stride_sblock + offs_n * stride_soff + kv_head
            k_scale = tl.load(k_scale_ptr + scale_offs, mask=mask_n, other=0.0).to(tl.float32)
            v_scale = tl.load(v_scale_ptr + scale_offs, mask=mask_n, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)

        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        scores = tl.where(mask_n[None, :], scores * scale, float("-inf"))

        # Online softmax: every visited block holds >= 1 visible token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # An empty context (length 0) yields zeros rather than 0/0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None]
    out_ptrs = out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context (with a window,
    only its last `window` tokens, itself included: a sliding-window layer).

    q [B, Hq, D]; key_cache/value_cache [num_blocks, block_size, Hkv, D] (one layer);
    block_tables int32 [B, max_blocks] (padding ignored past context_lens); context_lens int32 [B].
    A quantized cache (fp8 e4m3 / int8 values) comes with key_scales/value_scales float16
    [num_blocks, block_size, Hkv]: each token-head's values are dequantized in registers.
    Returns out [B, Hq, D] in q's dtype, accumulated in fp32.
    """
    quantized = key_scales is not None or value_scales is not None
    if window is not None and window < 1:
        raise KernelInputError(f"window must be >= 1 token, got {window}")
    check_attention_inputs(q, key_cache, value_cache, block_tables, context_lens, out, quantized)
    if quantized:
        check_scales(key_cache, key_scales, value_scales)
    if out is None:
        out = torch.empty_like(q)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_g = max(triton.next_power_of_2(group), _MIN_DOT_DIM)
    block_n = triton.next_power_of_2(block_size)
    block_d = triton.next_power_of_2(head_dim)
    use_dot = block_n >= _MIN_DOT_DIM and block_d >= _MIN_DOT_DIM
    if not use_dot:
        block_g = triton.next_power_of_2(group)  # no padding needed for broadcast-sum
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8:  # loaded as bytes and bitcast in the kernel (the interpreter has no fp8 tensors)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    scale_strides = (key_scales.stride(0), key_scales.stride(1)) if quantized else (0, 0)
    _paged_decode_kernel[(batch, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        key_scales if quantized else q,
        value_scales if quantized else q,
        block_tables,
        context_lens,
        out,
        float(scale),
        int(window or 0),
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        USE_DOT=use_dot,
        QUANT=quantized,
        FP8=fp8,
        num_warps=4,
    )
    return out


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,
    num_ids,
    row_numel,
    stride_src_plane,
    stride_src_row,
    stride_dst_plane,
    stride_dst_row,
    GATHER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program (plane * num_ids + i, chunk) copies one BLOCK-sized chunk of row i.
    # GATHER: dst[plane, i] = src[plane, ids[i]]; else dst[plane, ids[i]] = src[plane, i].
    pid = tl.program_id(0).to(tl.int64)
    plane = pid // num_ids
    i = pid % num_ids
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    if GATHER:
        src_row = block_id
        dst_row = i
    else:
        src_row = i
        dst_row = block_id
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    values = tl.load(src_ptr + plane * stride_src_plane + src_row * stride_src_row + offs, mask=mask)
    tl.store(dst_ptr + plane * stride_dst_plane + dst_row * stride_dst_row + offs, values, mask=mask)


def _launch_copy(src, dst, block_ids, gather: bool) -> None:
    num_planes, num_ids, row_numel = (dst if gather else src).shape
    if num_planes == 0 or num_ids == 0 or row_numel == 0:
        return
    grid = (num_planes * num_ids, triton.cdiv(row_numel, _COPY_BLOCK))
    _copy_rows_kernel[grid](
        src,
        dst,
        block_ids,
        num_ids,
        row_numel,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        GATHER=gather,
        BLOCK=_COPY_BLOCK,
    )


def gather_blocks(src: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[p, i, :] = src[p, block_ids[i], :]; src [P, num_blocks, E], out [P, n, E]."""
    check_copy(out, src, block_ids)
    _launch_copy(src, out, block_ids, gather=True)
    return out


def scatter_blocks(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """dst[p, block_ids[i], :] = src[p, i, :]; src [P, n, E], dst [P, num_blocks, E]."""
    check_copy(src, dst, block_ids)
    _launch_copy(src, dst, block_ids, gather=False)
    return dst
