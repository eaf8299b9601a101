"""Triton kernels: paged decode attention and KV-block gather/scatter.

Importing this module needs triton but no GPU (the kernels are only compiled when launched);
under TRITON_INTERPRET=1 they run on CPU tensors, which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.config import DTYPES

# tl.dot needs every dimension >= 16 when compiled for a GPU; smaller tiles use broadcast-sum.
_MIN_DOT_DIM = 16
_COPY_BLOCK = 1024
_SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in DTYPES)


class KernelInputError(ValueError):
    """A kernel was called with tensors of the wrong shape, dtype, device or layout."""


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kblock,
    stride_koff,
    stride_khead,
    stride_vblock,
    stride_voff,
    stride_vhead,
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
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    for block_index in range(0, num_blocks):
        # int64: block * stride overflows int32 for large caches.
        block_id = tl.load(block_tables_ptr + seq * stride_bt + block_index).to(tl.int64)
        token = block_index * BLOCK_SIZE + offs_n
        mask_n = (offs_n < BLOCK_SIZE) & (token < context_len)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = (
            k_ptr + block_id * stride_kblock + offs_n[:, None] * stride_koff + kv_head * stride_khead + offs_d[None, :]
        )
        v_ptrs = (
            v_ptr + block_id * stride_vblock + offs_n[:, None] * stride_voff + kv_head * stride_vhead + offs_d[None, :]
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)

        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        scores = tl.where(mask_n[None, :], scores * scale, float("-inf"))

        # Online softmax: every visited block holds >= 1 valid token, so m_new is finite.
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


def _check_attention_inputs(q, key_cache, value_cache, block_tables, context_lens, out) -> None:
    if q.dim() != 3:
        raise KernelInputError(f"q must be [batch, q_heads, head_dim], got {tuple(q.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise KernelInputError(
            "key_cache/value_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise KernelInputError(f"head_dim mismatch: q {head_dim}, cache {key_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise KernelInputError(f"q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise KernelInputError(
            f"block_tables must be int32 [{batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32:
        raise KernelInputError(
            f"context_lens must be int32 [{batch}], got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    for name, tensor in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.dtype not in _SUPPORTED_DTYPES:
            raise KernelInputError(f"{name} dtype {tensor.dtype} not in {_SUPPORTED_DTYPES}")
        if tensor.stride(-1) != 1:
            raise KernelInputError(f"{name} must be contiguous in head_dim")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise KernelInputError(f"q/key/value dtypes differ: {q.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise KernelInputError(f"out must be {tuple(q.shape)} and contiguous in head_dim")
    devices = {t.device for t in (q, key_cache, value_cache, block_tables, context_lens)}
    if out is not None:
        devices.add(out.device)
    if len(devices) != 1:
        raise KernelInputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context.

    q [B, Hq, D]; key_cache/value_cache [num_blocks, block_size, Hkv, D] (one layer);
    block_tables int32 [B, max_blocks] (padding ignored past context_lens); context_lens int32 [B].
    Returns out [B, Hq, D] in q's dtype, accumulated in fp32.
    """
    _check_attention_inputs(q, key_cache, value_cache, block_tables, context_lens, out)
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
    _paged_decode_kernel[(batch, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        float(scale),
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
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


def _check_planes(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 3 or tensor.stride(-1) != 1:
        raise KernelInputError(
            f"{name} must be [planes, rows, row_numel] contiguous in its last dim, "
            f"got shape {tuple(tensor.shape)} strides {tensor.stride()}"
        )


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


def _check_copy(packed: torch.Tensor, paged: torch.Tensor, block_ids: torch.Tensor) -> None:
    _check_planes("packed", packed)
    _check_planes("paged", paged)
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"block_ids must be 1-D int32/int64, got {block_ids.dtype} {tuple(block_ids.shape)}")
    if packed.shape != (paged.shape[0], block_ids.shape[0], paged.shape[2]):
        raise KernelInputError(
            f"packed buffer {tuple(packed.shape)} does not match paged {tuple(paged.shape)} "
            f"with {block_ids.shape[0]} block ids"
        )
    if packed.dtype != paged.dtype:
        raise KernelInputError(f"dtype mismatch: {packed.dtype} vs {paged.dtype}")
    if len({packed.device, paged.device, block_ids.device}) != 1:
        raise KernelInputError("src, dst and block_ids must be on one device")


def gather_blocks(src: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[p, i, :] = src[p, block_ids[i], :]; src [P, num_blocks, E], out [P, n, E]."""
    _check_copy(out, src, block_ids)
    _launch_copy(src, out, block_ids, gather=True)
    return out


def scatter_blocks(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """dst[p, block_ids[i], :] = src[p, i, :]; src [P, n, E], dst [P, num_blocks, E]."""
    _check_copy(src, dst, block_ids)
    _launch_copy(src, dst, block_ids, gather=False)
    return dst
