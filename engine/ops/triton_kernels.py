"""Triton kernels: KV-block gather/scatter (decode attention: triton_decode_attention.py).

Importing this module needs triton but no GPU (the kernels are only compiled when launched);
under TRITON_INTERPRET=1 they run on CPU tensors, which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.ops.triton_input_checks import check_copy

__all__ = ["gather_blocks", "scatter_blocks"]

_COPY_BLOCK = 1024


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
