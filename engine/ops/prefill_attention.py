"""Prefill attention over one sequence's context: its new queries at the end of the context,
causal, and for a sliding-window layer only the last `window` keys of each query. A long
windowed prompt runs in query tiles, each against its own span of keys, so the work grows with
queries x (tile + window) rather than queries x context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """q [n, Hq, D] are the last n positions of a context whose last keys/values [m, Hkv, D]
    are given (m >= n; with a window, at least the window - 1 positions before the queries).
    A query sees the keys up to itself, and with a window only the last `window` of them."""
    num_queries, num_keys = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    gqa = q.shape[1] != keys.shape[1]
    if window is not None and num_keys > window:
        return _windowed_prefill_attention(qh, kh, vh, scale, window, gqa).transpose(0, 1)
    if num_queries == num_keys:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Causal with the queries aligned to the end of the context (a cached prefix first).
        query_pos = torch.arange(num_keys - num_queries, num_keys, device=q.device)
        mask = torch.arange(num_keys, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


# Queries per SDPA call of a windowed prefill: each tile reads its own span of keys, so the
# work grows with queries x (tile + window), not queries x context.
_WINDOW_TILE = 256


def _windowed_prefill_attention(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, scale: float, window: int, gqa: bool
) -> torch.Tensor:
    """_prefill_attention's sliding-window case, heads first: qh [Hq, n, D], kh/vh [Hkv, m, D]."""
    num_queries, num_keys = qh.shape[1], kh.shape[1]
    out = torch.empty_like(qh)
    tile = max(window, _WINDOW_TILE)
    offset = num_keys - num_queries  # key index of the first query's own position
    for lo in range(0, num_queries, tile):
        hi = min(lo + tile, num_queries)
        first_key = max(offset + lo - window + 1, 0)
        query_pos = torch.arange(offset + lo, offset + hi, device=qh.device)[:, None]
        key_pos = torch.arange(first_key, offset + hi, device=qh.device)[None, :]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        keys, values = kh[:, first_key : offset + hi], vh[:, first_key : offset + hi]
        out[:, lo:hi] = F.scaled_dot_product_attention(
            qh[:, lo:hi], keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out
