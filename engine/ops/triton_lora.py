"""Triton LoRA kernels: a step's per-token LoRA delta over the adapter slots, BGMV-style (punica).

Each token reads its own adapter slot's matrices, by a per-token slot index (NO_ADAPTER = -1: a
base token, which gets no delta): the shrink s[t] = x[t] @ A[slot[t]] and the expand
out[t] += scaling[slot[t]] * s[t] @ B[slot[t]]. One launch covers every adapter of the step, in
any token order, with no sort, gather or padding. The tensors are engine/lora/lora_slots.py's
as they are: a projection group's A transposed and side by side [slots, in, targets * rank],
and a target's B transposed [slots, rank, out].

A program is one token times a tile of output columns, and multiplies by broadcast-sum in fp32
(tl.dot needs every dimension >= 16; a rank is often 8): the memory-bound shape of a decode
step, where each token's A and B are read once. Under TRITON_INTERPRET=1 they run on CPU
tensors (tests/helpers/triton_cases.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.ops.triton_input_checks import KernelInputError, check_lora_expand, check_lora_shrink

__all__ = ["KernelInputError", "lora_expand", "lora_shrink"]

_BLOCK_K = 64  # input features per step of the shrink's loop
_BLOCK_N = 64  # output columns per program of the expand


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    in_dim,
    cols,
    stride_xt,
    stride_as,
    stride_ak,
    stride_an,
    stride_ot,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (token, column tile): out[token, tile] = x[token] @ a[slot, :, tile], fp32.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    active = slot >= 0
    safe_slot = tl.where(active, slot, 0)
    # A base token reads nothing: no input feature is in range. (Limits, not `& active`: a
    # scalar and a vector mask combined are no mask the interpreter takes.)
    k_limit = tl.where(active, in_dim, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < cols
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, in_dim, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_limit
        x = tl.load(x_ptr + token * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a_ptrs = a_ptr + safe_slot * stride_as + offs_k[:, None] * stride_ak + offs_n[None, :] * stride_an
        a = tl.load(a_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None] * a, axis=0)
    # A base token's row is zeros (its loads were all masked): the expand skips it anyway.
    tl.store(out_ptr + token * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _lora_expand_kernel(
    s_ptr,
    b_ptr,
    slots_ptr,
    scaling_ptr,
    out_ptr,
    rank,
    cols,
    stride_st,
    stride_bs,
    stride_br,
    stride_bn,
    stride_ot,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (token, column tile): out[token, tile] += scaling[slot] * s[token] @ b[slot, :, tile].
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    active = slot >= 0
    safe_slot = tl.where(active, slot, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    # A base token stores nothing: its output is exactly the base model's.
    mask_n = offs_n < tl.where(active, cols, 0)
    mask_r = offs_r < tl.where(active, rank, 0)
    s = tl.load(s_ptr + token * stride_st + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    b_ptrs = b_ptr + safe_slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn
    b = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    scale = tl.load(scaling_ptr + safe_slot).to(tl.float32)
    delta = tl.sum(s[:, None] * b, axis=0) * scale
    out_ptrs = out_ptr + token * stride_ot + offs_n
    current = tl.load(out_ptrs, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (current + delta).to(out_ptr.dtype.element_ty), mask=mask_n)


def lora_shrink(x: torch.Tensor, a_t: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor | None = None):
    """out[t] = x[t] @ a_t[token_slots[t]] (zeros for a token with slot -1), accumulated in fp32.

    x [tokens, in]; a_t [slots, in, cols] (any strides); token_slots int32/int64 [tokens];
    out [tokens, cols], float32 by default. Returns out."""
    check_lora_shrink(x, a_t, token_slots, out)
    tokens, in_dim = x.shape
    cols = a_t.shape[2]
    if out is None:
        out = torch.empty(tokens, cols, dtype=torch.float32, device=x.device)
    if tokens == 0 or cols == 0:
        return out
    block_n = min(_BLOCK_N, triton.next_power_of_2(cols))
    grid = (tokens, triton.cdiv(cols, block_n))
    _lora_shrink_kernel[grid](
        x,
        a_t,
        token_slots,
        out,
        in_dim,
        cols,
        x.stride(0),
        a_t.stride(0),
        a_t.stride(1),
        a_t.stride(2),
        out.stride(0),
        BLOCK_K=min(_BLOCK_K, triton.next_power_of_2(in_dim)),
        BLOCK_N=block_n,
    )
    return out


def lora_expand(
    shrunk: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, scaling: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[t] += scaling[token_slots[t]] * shrunk[t] @ b[token_slots[t]], in place; a token with
    slot -1 is left as it is. shrunk [tokens, rank] (a column slice of the shrink's output is
    fine); b [slots, rank, cols]; scaling [slots]; out [tokens, cols] (a column slice too)."""
    check_lora_expand(shrunk, b, token_slots, scaling, out)
    tokens, rank = shrunk.shape
    cols = b.shape[2]
    if tokens == 0 or cols == 0:
        return out
    grid = (tokens, triton.cdiv(cols, _BLOCK_N))
    _lora_expand_kernel[grid](
        shrunk,
        b,
        token_slots,
        scaling,
        out,
        rank,
        cols,
        shrunk.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_N=_BLOCK_N,
    )
    return out
