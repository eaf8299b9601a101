"""Attention over the paged KV cache: torch paths for CPU, Triton decode kernel on CUDA.

Caches are [num_blocks, block_size, num_kv_heads, head_dim] (one layer, K or V). A token at
slot s lives in block s // block_size at offset s % block_size.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values [T, kv_heads, head_dim] into their cache slots."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    key_cache.view(flat).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.view(flat).index_copy_(0, slot_mapping, v.to(value_cache.dtype))


@functools.lru_cache(maxsize=1)
def _triton_decode():
    """engine.triton_kernels.paged_decode_attention, or None where Triton cannot run."""
    try:
        from engine.triton_kernels import paged_decode_attention
    except ImportError:
        return None
    return paged_decode_attention


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[B, num_blocks * block_size, kv_heads, head_dim]: each sequence's blocks side by side."""
    batch = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    ids = block_tables[:, :num_blocks].reshape(-1).to(torch.int64)
    return cache.index_select(0, ids).view(batch, num_blocks * block_size, num_kv_heads, head_dim)


def paged_decode_attention_torch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                 max_context_len: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D].

    Each sequence's blocks are gathered and padded to the longest context; padding is masked.
    GQA is computed without repeating K/V: the query heads that share a KV head ride along
    the query-length axis of scaled_dot_product_attention.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    num_blocks = -(-max_context_len // block_size)
    keys = _gather_context(key_cache, block_tables, num_blocks).transpose(1, 2)
    values = _gather_context(value_cache, block_tables, num_blocks).transpose(1, 2)
    positions = torch.arange(num_blocks * block_size, device=q.device)
    mask = (positions[None, :] < context_lens[:, None].to(positions.dtype))[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv_heads, group, head_dim), keys, values, attn_mask=mask, scale=scale)
    return out.view(batch, num_heads, head_dim)


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     max_context_len: int) -> torch.Tensor:
    """Batched decode: the Triton kernel on CUDA when available, else the torch path."""
    if q.is_cuda:
        kernel = _triton_decode()
        if kernel is not None:
            return kernel(q, key_cache, value_cache, block_tables, context_lens, scale)
    return paged_decode_attention_torch(q, key_cache, value_cache, block_tables, context_lens,
                                        scale, max_context_len)


def _prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [n, Hq, D] are the last n positions of a context with keys/values [ctx, Hkv, D]."""
    num_queries, context_len = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    gqa = q.shape[1] != keys.shape[1]
    if num_queries == context_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Causal with the queries aligned to the end of the context (a cached prefix first).
        query_pos = torch.arange(context_len - num_queries, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, new_keys: torch.Tensor | None = None,
                    new_values: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a flattened batch q [T, Hq, D] -> [T, Hq, D].

    The new tokens' K/V must already be in the cache (write_kv). new_keys/new_values [T, Hkv, D]
    are optional copies of them: a prompt with no cached prefix then attends to them directly
    instead of gathering its blocks back out of the cache.
    """
    if meta.is_pure_decode:
        return decode_attention(q, key_cache, value_cache, meta.block_tables, meta.context_lens,
                                scale, meta.max_context_len)
    out = torch.empty_like(q)
    starts, context_lens = meta.query_start_loc_cpu, meta.context_lens_cpu
    block_size = key_cache.shape[1]
    seq = 0
    while seq < meta.num_seqs:
        start, end = starts[seq], starts[seq + 1]
        if end - start == 1:
            # A run of decode sequences: one batched call for all of them.
            last = seq
            while last + 1 < meta.num_seqs and starts[last + 2] - starts[last + 1] == 1:
                last += 1
            rows = slice(start, starts[last + 1])
            out[rows] = decode_attention(
                q[rows], key_cache, value_cache, meta.block_tables[seq:last + 1],
                meta.context_lens[seq:last + 1], scale, max(context_lens[seq:last + 1]))
            seq = last + 1
            continue
        context_len = context_lens[seq]
        if end - start == context_len and new_keys is not None and new_values is not None:
            keys, values = new_keys[start:end], new_values[start:end]
        else:
            num_blocks = -(-context_len // block_size)
            table = meta.block_tables[seq:seq + 1]
            keys = _gather_context(key_cache, table, num_blocks)[0, :context_len]
            values = _gather_context(value_cache, table, num_blocks)[0, :context_len]
        out[start:end] = _prefill_attention(q[start:end], keys, values, scale)
        seq += 1
    return out
