"""Prefill attention for many sequences of one step in one SDPA call.

Each sequence's new queries sit at the end of its context (a fresh prompt, or a chunk after a
cached prefix). The sequences of a group are padded into one [B, H, Q, K] call whose boolean
mask makes every query see exactly the keys its own sequence's causal mask allows; a padded
query row sees key 0 only (a row with no visible key would be NaN) and is dropped afterwards.
The call is 4-D, which on CPU takes SDPA's flash kernel; one call per group instead of one
per sequence also saves the per-call overhead (bench/results/engine_throughput.md, Prefill).

A group of fresh prompts of one length, consecutive in the batch (the common case of a step
full of new requests), needs neither padding nor a mask: its queries and new K/V are viewed as
[B, n, H, D] in place and attend with is_causal, which also skips the blocks above the
diagonal (split_fresh_runs, uniform_prefill_attention).

Padding costs work, so sequences are grouped by query length: a group grows only while its
padded area (B x Q x K) stays within PADDING_BUDGET times the real one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Padded query x key area a group may reach, as a multiple of its sequences' real area.
PADDING_BUDGET = 1.5


@dataclass(frozen=True)
class PrefillRow:
    """One prefill sequence of a step: its index in the batch, its query rows [start, end) of
    the flattened batch, and its context length after this step."""

    seq: int
    start: int
    end: int
    context_len: int

    @property
    def num_queries(self) -> int:
        return self.end - self.start


def group_prefills(rows: list[PrefillRow], budget: float = PADDING_BUDGET) -> list[list[PrefillRow]]:
    """Rows in groups of similar shape, longest queries first: each group's padded area stays
    within budget x its real area (a row alone is always a group)."""
    groups: list[list[PrefillRow]] = []
    real = 0
    for row in sorted(rows, key=lambda r: (r.num_queries, r.context_len), reverse=True):
        area = row.num_queries * row.context_len
        if groups:
            group = groups[-1]
            width = max(r.context_len for r in group + [row])
            padded = (len(group) + 1) * group[0].num_queries * width
            if padded <= budget * (real + area):
                group.append(row)
                real += area
                continue
        groups.append([row])
        real = area
    return groups


def batched_prefill_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: list[PrefillRow],
    scale: float,
    out: torch.Tensor,
) -> None:
    """q: the flattened batch's queries [T, Hq, D]; keys/values [B, K, Hkv, D]: each row's
    context from position 0 (beyond its context_len anything, masked). Writes the group's rows
    of out [T, Hq, D]."""
    batch, device = len(group), q.device
    width = max(r.num_queries for r in group)
    num_keys = max(r.context_len for r in group)
    keys, values = keys[:, :num_keys], values[:, :num_keys]
    _, num_heads, head_dim = q.shape
    # Flat index of every real query row within the padded [B * width] rows, and its source row.
    dest = torch.cat([torch.arange(r.num_queries) + b * width for b, r in enumerate(group)]).to(device)
    source = torch.cat([torch.arange(r.start, r.end) for r in group]).to(device)
    padded = q.new_zeros(batch * width, num_heads, head_dim)
    padded.index_copy_(0, dest, q.index_select(0, source))
    # Query i of row b is at position context_len - num_queries + i; padding rows at 0.
    offsets = torch.tensor([r.context_len - r.num_queries for r in group], device=device)
    counts = torch.tensor([r.num_queries for r in group], device=device)
    index = torch.arange(width, device=device)
    positions = torch.where(index[None, :] < counts[:, None], offsets[:, None] + index[None, :], 0)
    mask = torch.arange(num_keys, device=device)[None, None, :] <= positions[:, :, None]
    attended = F.scaled_dot_product_attention(
        padded.view(batch, width, num_heads, head_dim).transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != keys.shape[2],
    )
    attended = attended.transpose(1, 2).reshape(batch * width, num_heads, head_dim)
    out.index_copy_(0, source, attended.index_select(0, dest))


def split_fresh_runs(rows: list[PrefillRow]) -> tuple[list[list[PrefillRow]], list[PrefillRow]]:
    """(runs, rest): runs are maximal runs of fresh prompts (no cached prefix) of one length,
    consecutive in the flattened batch, which uniform_prefill_attention takes; rest is every
    other row (chunks after a cached prefix), for group_prefills."""
    runs: list[list[PrefillRow]] = []
    rest: list[PrefillRow] = []
    for row in rows:
        if row.num_queries != row.context_len:
            rest.append(row)
        elif runs and runs[-1][-1].end == row.start and runs[-1][-1].num_queries == row.num_queries:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs, rest


def uniform_prefill_attention(
    q: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    group: list[PrefillRow],
    scale: float,
    out: torch.Tensor,
) -> None:
    """batched_prefill_attention for a run of split_fresh_runs, reading the new tokens' K/V
    [T, Hkv, D] in place: no copy, no mask."""
    batch, length = len(group), group[0].num_queries
    rows = slice(group[0].start, group[-1].end)
    shape = (batch, length, -1, q.shape[-1])
    attended = F.scaled_dot_product_attention(
        q[rows].view(shape).transpose(1, 2),
        new_keys[rows].view(shape).transpose(1, 2),
        new_values[rows].view(shape).transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != new_keys.shape[1],
    )
    out[rows] = attended.transpose(1, 2).reshape(rows.stop - rows.start, *q.shape[1:])
