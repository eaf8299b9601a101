"""Attention over the paged KV cache.

Decode: the Triton kernel on CUDA; on CPU (fp32) a sparse plan that reads K/V in place
(engine/ops/sparse_decode.py); otherwise gather + SDPA. Prefill and chunked prefill: the step's
sequences padded into few SDPA calls, each query masked causally from the end of its context
(engine/ops/batched_prefill.py); a sliding-window layer's per sequence (engine/ops/prefill_attention.py).

A sliding-window layer (window W) reads only each query's last W positions, itself included,
as transformers masks them; every path starts reading at the block holding the first of them,
so blocks wholly before it are never read and may be freed (engine/core/kv_cache_manager.py).

Caches are [num_blocks, block_size, num_kv_heads, head_dim] (one layer, K or V), or a
QuantizedKV of that shape (fp8/int8 values + per-token scales): writes quantize, reads
dequantize the gathered blocks (CPU: gather + SDPA; CUDA: the Triton kernel dequantizes in
registers). A token at slot s lives in block s // block_size at offset s % block_size.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.ops.batched_prefill import (
    PrefillRow,
    batched_prefill_attention,
    group_prefills,
    split_fresh_runs,
    uniform_prefill_attention,
)
from splitserve.engine.ops.prefill_attention import prefill_attention
from splitserve.engine.ops.quantized_kv import QuantizedKV
from splitserve.engine.ops.sparse_decode import SUPPORTED_DTYPES, SparseDecodePlan

Cache = torch.Tensor | QuantizedKV


def write_kv(
    key_cache: Cache, value_cache: Cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys/values [T, kv_heads, head_dim] into their cache slots."""
    if isinstance(key_cache, QuantizedKV):
        key_cache.write(k, slot_mapping)
        value_cache.write(v, slot_mapping)
        return
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    key_cache.view(flat).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.view(flat).index_copy_(0, slot_mapping, v.to(value_cache.dtype))


@functools.lru_cache(maxsize=1)
def _triton_decode():
    """splitserve.engine.ops.triton_decode_attention.paged_decode_attention, or None where Triton cannot run."""
    try:
        from splitserve.engine.ops.triton_decode_attention import paged_decode_attention
    except ImportError:
        return None
    return paged_decode_attention


def _gather_context(cache: Cache, block_tables: torch.Tensor, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, num_blocks * block_size, kv_heads, head_dim] in dtype: each sequence's blocks side
    by side (dequantized from a QuantizedKV)."""
    batch = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    ids = block_tables[:, :num_blocks].reshape(-1)
    if isinstance(cache, QuantizedKV):
        blocks = cache.gather(ids, dtype)
    else:
        blocks = cache.index_select(0, ids)
    return blocks.view(batch, num_blocks * block_size, num_kv_heads, head_dim)


def sparse_decode_supported(q: torch.Tensor, key_cache: Cache) -> bool:
    # The sparse plan multiplies the cache in place: an 8-bit cache has to be dequantized first.
    return (
        not q.is_cuda
        and q.dtype in SUPPORTED_DTYPES
        and not isinstance(key_cache, QuantizedKV)
        and key_cache.dtype == q.dtype
    )


def _visible_blocks(
    block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int, block_size: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's blocks from the first one its decode query sees (with a window, the
    blocks before it may be freed already): (tables [B, n], the position of every gathered
    token [B, n * block_size])."""
    num_blocks = -(-max_context_len // block_size)
    device = block_tables.device
    if window is None:
        first = torch.zeros(block_tables.shape[0], dtype=torch.int64, device=device)
        tables = block_tables[:, :num_blocks]
    else:
        # `window` positions from any offset span at most this many blocks.
        num_blocks = min(num_blocks, -(-(window + block_size - 1) // block_size))
        first = torch.div((context_lens.long() - window).clamp_(min=0), block_size, rounding_mode="floor")
        index = (first[:, None] + torch.arange(num_blocks, device=device)).clamp_(max=block_tables.shape[1] - 1)
        tables = block_tables.gather(1, index)  # past a table's end: masked out below
    positions = first[:, None] * block_size + torch.arange(num_blocks * block_size, device=device)
    return tables, positions


def paged_decode_attention_torch(
    q: torch.Tensor,
    key_cache: Cache,
    value_cache: Cache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    plan: SparseDecodePlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D]; window: the tokens each query
    sees, itself included (a sliding-window layer), None: its whole context.

    CPU fp32 batches read K/V in place through a SparseDecodePlan (pass one to share it
    across layers). Otherwise each sequence's visible blocks are gathered, padded to the
    longest and masked; GQA rides along the query-length axis of SDPA, so K/V are never
    repeated per query head.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if batch > 1 and sparse_decode_supported(q, key_cache):
        if plan is None:
            plan = SparseDecodePlan(
                block_tables, context_lens, max_context_len, block_size, num_kv_heads, num_heads, window
            )
        return plan.attend(q, key_cache, value_cache, scale)
    group = num_heads // num_kv_heads
    q4 = q.view(batch, num_kv_heads, group, head_dim)
    if batch == 1:
        # Nothing to pad: attend to exactly the visible context, no mask needed.
        start = 0 if window is None else max(max_context_len - window, 0)
        first = start // block_size
        table = block_tables[:, first:]
        num_blocks = -(-max_context_len // block_size) - first
        visible = slice(start - first * block_size, max_context_len - first * block_size)
        keys = _gather_context(key_cache, table, num_blocks, q.dtype)[:, visible]
        values = _gather_context(value_cache, table, num_blocks, q.dtype)[:, visible]
        out = F.scaled_dot_product_attention(q4, keys.transpose(1, 2), values.transpose(1, 2), scale=scale)
        return out.reshape(batch, num_heads, head_dim)
    tables, positions = _visible_blocks(block_tables, context_lens, max_context_len, block_size, window)
    keys = _gather_context(key_cache, tables, tables.shape[1], q.dtype)
    values = _gather_context(value_cache, tables, tables.shape[1], q.dtype)
    context = context_lens.long()[:, None]
    mask = positions < context
    if window is not None:
        mask &= positions >= context - window
    mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q4, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def decode_attention(
    q: torch.Tensor,
    key_cache: Cache,
    value_cache: Cache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    plan: SparseDecodePlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Batched decode: the Triton kernel on CUDA when available, else the torch path."""
    if q.is_cuda:
        kernel = _triton_decode()
        if kernel is not None:
            if isinstance(key_cache, QuantizedKV):
                return kernel(
                    q,
                    key_cache.values,
                    value_cache.values,
                    block_tables,
                    context_lens,
                    scale,
                    key_scales=key_cache.scales,
                    value_scales=value_cache.scales,
                    window=window,
                )
            return kernel(q, key_cache, value_cache, block_tables, context_lens, scale, window=window)
    return paged_decode_attention_torch(
        q, key_cache, value_cache, block_tables, context_lens, scale, max_context_len, plan, window
    )


def make_decode_plan(
    meta: AttentionMetadata, q_like: torch.Tensor, key_cache: Cache, num_heads: int, window: int | None = None
) -> SparseDecodePlan | None:
    """The shared plan for a pure-decode step on CPU, for the layers of one window (None
    where it does not apply)."""
    if not meta.is_pure_decode or meta.num_seqs < 2 or not sparse_decode_supported(q_like, key_cache):
        return None
    return SparseDecodePlan(
        meta.block_tables,
        meta.context_lens,
        meta.max_context_len,
        key_cache.shape[1],
        key_cache.shape[2],
        num_heads,
        window,
    )


def paged_attention(
    q: torch.Tensor,
    key_cache: Cache,
    value_cache: Cache,
    meta: AttentionMetadata,
    scale: float,
    new_keys: torch.Tensor | None = None,
    new_values: torch.Tensor | None = None,
    decode_plan: SparseDecodePlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention for a flattened batch q [T, Hq, D] -> [T, Hq, D].

    The new tokens' K/V must already be in the cache (write_kv). new_keys/new_values [T, Hkv, D]
    are optional copies of them: a sliding-window layer's prompt with no cached prefix then
    attends to them directly instead of gathering its blocks back out of the cache. decode_plan (from
    make_decode_plan, for the same window) lets all layers of a pure-decode step share one plan.
    window: a sliding-window layer's, the tokens each query sees (itself included); only
    those are read, so blocks wholly before every query's window may be freed already.
    """
    if meta.is_pure_decode:
        return decode_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            meta.max_context_len,
            decode_plan,
            window,
        )
    out = torch.empty_like(q)
    starts, context_lens = meta.query_start_loc_cpu, meta.context_lens_cpu
    block_size = key_cache.shape[1]
    prefills: list[PrefillRow] = []  # without a window: attended in groups, after the loop
    # A quantized cache is always read back, so a prompt attends to the same (dequantized)
    # K/V whether its prefix was cached or not: a prefix-cache hit changes no output.
    fresh = None
    if new_keys is not None and new_values is not None and not isinstance(key_cache, QuantizedKV):
        fresh = new_keys, new_values
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
                q[rows],
                key_cache,
                value_cache,
                meta.block_tables[seq : last + 1],
                meta.context_lens[seq : last + 1],
                scale,
                max(context_lens[seq : last + 1]),
                window=window,
            )
            seq = last + 1
            continue
        if window is None:
            prefills.append(PrefillRow(seq, start, end, context_lens[seq]))
            seq += 1
            continue
        context_len = context_lens[seq]
        if end - start == context_len and fresh is not None:
            keys, values = fresh[0][start:end], fresh[1][start:end]
        else:
            # From the first key the first query sees: with a window, not the blocks before it.
            first_key = max(context_len - (end - start) - window + 1, 0)
            first = first_key // block_size
            table = meta.block_tables[seq : seq + 1, first:]
            num_blocks = -(-context_len // block_size) - first
            visible = slice(first_key - first * block_size, context_len - first * block_size)
            keys = _gather_context(key_cache, table, num_blocks, q.dtype)[0, visible]
            values = _gather_context(value_cache, table, num_blocks, q.dtype)[0, visible]
        out[start:end] = prefill_attention(q[start:end], keys, values, scale, window)
        seq += 1
    if fresh is not None:
        runs, prefills = split_fresh_runs(prefills)
        for run in runs:
            uniform_prefill_attention(q, *fresh, run, scale, out)
    for group in group_prefills(prefills):
        _attend_prefill_group(q, key_cache, value_cache, meta, scale, group, out)
    return out


def _attend_prefill_group(
    q: torch.Tensor,
    key_cache: Cache,
    value_cache: Cache,
    meta: AttentionMetadata,
    scale: float,
    group: list[PrefillRow],
    out: torch.Tensor,
) -> None:
    """One SDPA call for a group of prefill sequences (engine/ops/batched_prefill.py), their
    contexts gathered from the cache side by side."""
    block_size = key_cache.shape[1]
    num_blocks = -(-max(row.context_len for row in group) // block_size)
    tables = meta.block_tables[torch.tensor([row.seq for row in group], device=q.device)]
    keys = _gather_context(key_cache, tables, num_blocks, q.dtype)
    values = _gather_context(value_cache, tables, num_blocks, q.dtype)
    batched_prefill_attention(q, keys, values, group, scale, out)
