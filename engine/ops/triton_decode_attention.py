"""Triton paged decode attention (16/32-bit or fp8/int8 KV), split over the context when the
batch alone cannot fill the GPU ("flash-decoding").

One program per (sequence, KV head, split) walks its split's share of the context in tiles of
several cache blocks; with more than one split each writes its partial softmax state (max,
sum of exponentials, unnormalised output) to float32 scratch and a small reduce kernel
combines the splits with the log-sum-exp rule. One split normalises and writes `out` directly.

Importing this module needs triton but no GPU (the kernels are only compiled when launched);
under TRITON_INTERPRET=1 they run on CPU tensors, which is how the tests check them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from splitserve.engine.ops.triton_input_checks import KernelInputError, check_attention_inputs, check_scales

__all__ = ["choose_num_splits", "multiprocessors", "paged_decode_attention"]

# tl.dot needs every dimension >= 16 when compiled for a GPU; smaller tiles use broadcast-sum.
_MIN_DOT_DIM = 16
# Split only until about this many programs per SM are queued (several resident per SM keep
# enough loads in flight to hide HBM latency), and never below _MIN_SPLIT_TOKENS of context per split.
_PROGRAMS_PER_SM = 8
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64
_DEFAULT_SMS = 132  # an H100/H200; used where no CUDA device says otherwise (the interpreter)
_TILE_TOKENS = 64  # tokens per loop iteration (several 16-token blocks), 32 for head_dim > 128


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
    part_ptr,
    scale,
    window,
    num_splits,
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
    BLOCK_PAD: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    QUANT: tl.constexpr,
    FP8: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # One program = one sequence x one KV head x one split, covering the head's GROUP query heads.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    # A tile is TILE_BLOCKS cache blocks, each padded to BLOCK_PAD (a power of two) rows.
    offs_n = tl.arange(0, TILE_BLOCKS * BLOCK_PAD)
    tile_block = offs_n // BLOCK_PAD
    in_block = offs_n % BLOCK_PAD
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
    first_block = first_token // BLOCK_SIZE
    # Each split takes an equal share of this sequence's visible blocks, whole tiles where it
    # can; a short sequence leaves its last splits empty (they report max -inf, sum 0).
    per_split = tl.cdiv(tl.cdiv(num_blocks - first_block, num_splits), TILE_BLOCKS) * TILE_BLOCKS
    start = first_block + split * per_split
    end = tl.minimum(start + per_split, num_blocks)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    for tile_start in range(start, end, TILE_BLOCKS):
        block_index = tile_start + tile_block
        in_split = block_index < end
        # int64: block * stride overflows int32 for large caches.
        block_id = tl.load(block_tables_ptr + seq * stride_bt + block_index, mask=in_split, other=0).to(tl.int64)
        token = block_index * BLOCK_SIZE + in_block
        mask_n = in_split & (in_block < BLOCK_SIZE) & (token < context_len) & (token >= first_token)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        row = block_id * stride_kblock + in_block * stride_koff + kv_head * stride_khead
        k_ptrs = k_ptr + row[:, None] + offs_d[None, :]
        row = block_id * stride_vblock + in_block * stride_voff + kv_head * stride_vhead
        v_ptrs = v_ptr + row[:, None] + offs_d[None, :]
        if QUANT:
            # 8-bit values times their per-(token, head) scale; fp8 arrives as raw bytes.
            k = tl.load(k_ptrs, mask=kv_mask, other=0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0)
            if FP8:
                k = k.to(tl.float8e4nv, bitcast=True)
                v = v.to(tl.float8e4nv, bitcast=True)
            scale_offs = block_id * stride_sblock + in_block * stride_soff + kv_head
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

        # Online softmax: a tile's first block is visible and holds >= 1 visible token, so m_new is finite.
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

    mask_gd = mask_g[:, None] & mask_d[None, :]
    if SPLIT:
        # Scratch [B, Hq, splits, 2 + D] float32: max, sum of exponentials, unnormalised output.
        part = (seq * tl.num_programs(1) * GROUP + q_heads) * num_splits + split
        part_row = part_ptr + part * (2 + HEAD_DIM)
        tl.store(part_row, m_i, mask=mask_g)
        tl.store(part_row + 1, l_i, mask=mask_g)
        tl.store(part_row[:, None] + 2 + offs_d[None, :], acc, mask=mask_gd)
    else:
        # An empty context (length 0) yields zeros rather than 0/0.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out_ptrs = out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask_gd)


@triton.jit
def _combine_splits_kernel(
    part_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program = one sequence x one query head: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    rows = part_ptr + ((seq * tl.num_programs(1) + head) * num_splits + offs_s) * (2 + HEAD_DIM)
    m = tl.load(rows, mask=mask_s, other=float("-inf"))
    l_s = tl.load(rows + 1, mask=mask_s, other=0.0)
    acc = tl.load(rows[:, None] + 2 + offs_d[None, :], mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    m_max = tl.max(m, axis=0)
    # Empty splits (and an empty context, where every split is empty) weigh 0, not e^(-inf + inf).
    weight = tl.where(m > float("-inf"), tl.exp(m - tl.where(m_max > float("-inf"), m_max, 0.0)), 0.0)
    total = tl.sum(weight * l_s, axis=0)
    result = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0.0, total, 1.0)
    out_ptrs = out_ptr + seq * stride_ob + head * stride_oh + offs_d
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.lru_cache(maxsize=8)
def multiprocessors(device: torch.device) -> int:
    """The device's SM count (what the split choice fills)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, multiprocessors: int) -> int:
    """Splits of each sequence's context: enough (sequence, KV head, split) programs for about
    _PROGRAMS_PER_SM per SM, each split >= _MIN_SPLIT_TOKENS of the longest possible context
    (max_tokens: the block table's width, or a window); 1 where the batch fills the GPU alone."""
    programs = max(batch * num_kv_heads, 1)
    wanted = -(-multiprocessors * _PROGRAMS_PER_SM // programs)
    return max(1, min(wanted, max_tokens // _MIN_SPLIT_TOKENS, _MAX_SPLITS))


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context (with a window,
    only its last `window` tokens, itself included: a sliding-window layer).

    q [B, Hq, D]; key_cache/value_cache [num_blocks, block_size, Hkv, D] (one layer);
    block_tables int32 [B, max_blocks] (padding ignored past context_lens); context_lens int32 [B].
    A quantized cache (fp8 e4m3 / int8 values) comes with key_scales/value_scales float16
    [num_blocks, block_size, Hkv]: each token-head's values are dequantized in registers.
    num_splits: context splits per sequence, None: choose_num_splits (from shapes only, no sync).
    Returns out [B, Hq, D] in q's dtype, accumulated in fp32.
    """
    quantized = key_scales is not None or value_scales is not None
    if window is not None and window < 1:
        raise KernelInputError(f"window must be >= 1 token, got {window}")
    if num_splits is not None and num_splits < 1:
        raise KernelInputError(f"num_splits must be >= 1, got {num_splits}")
    check_attention_inputs(q, key_cache, value_cache, block_tables, context_lens, out, quantized)
    if quantized:
        check_scales(key_cache, key_scales, value_scales)
    if out is None:
        out = torch.empty_like(q)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if batch == 0:
        return out
    max_tokens = block_tables.shape[1] * block_size
    if window is not None:  # a window spans at most this many blocks' tokens
        max_tokens = min(max_tokens, (-(-(window - 1) // block_size) + 1) * block_size)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_tokens, multiprocessors(q.device))
    group = num_q_heads // num_kv_heads
    block_pad = triton.next_power_of_2(block_size)
    block_d = triton.next_power_of_2(head_dim)
    tile_tokens = _TILE_TOKENS if block_d <= 128 else _TILE_TOKENS // 2
    # No more blocks per tile than a split can hold (short contexts keep small tiles).
    split_blocks = -(-max_tokens // (block_size * num_splits))
    tile_blocks = min(max(tile_tokens // block_pad, 1), triton.next_power_of_2(split_blocks))
    use_dot = tile_blocks * block_pad >= _MIN_DOT_DIM and block_d >= _MIN_DOT_DIM
    # tl.dot pads the query group to 16 rows; broadcast-sum needs no padding.
    block_g = max(triton.next_power_of_2(group), _MIN_DOT_DIM) if use_dot else triton.next_power_of_2(group)
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8:  # loaded as bytes and bitcast in the kernel (the interpreter has no fp8 tensors)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    scale_strides = (key_scales.stride(0), key_scales.stride(1)) if key_scales is not None else (0, 0)
    split = num_splits > 1
    partials = (
        torch.empty(batch, num_q_heads, num_splits, 2 + head_dim, dtype=torch.float32, device=q.device)
        if split
        else out
    )
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        key_scales if quantized else q,
        value_scales if quantized else q,
        block_tables,
        context_lens,
        out,
        partials,
        float(scale),
        int(window or 0),
        num_splits,
        *q.stride()[:2],
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        *scale_strides,
        block_tables.stride(0),
        *out.stride()[:2],
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_SIZE=block_size,
        BLOCK_PAD=block_pad,
        TILE_BLOCKS=tile_blocks,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        USE_DOT=use_dot,
        QUANT=quantized,
        FP8=fp8,
        SPLIT=split,
        num_warps=4,
    )
    if split:
        _combine_splits_kernel[(batch, num_q_heads)](
            partials,
            out,
            num_splits,
            *out.stride()[:2],
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
