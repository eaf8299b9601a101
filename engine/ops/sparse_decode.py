"""Batched CPU decode attention that reads K/V straight out of the paged cache.

Gathering every sequence's blocks into a padded tensor writes as many bytes as the attention
then reads, and on CPU decode is bound by exactly that memory traffic. Here the cache is
viewed as a table with one row per (slot, kv_head), and
  scores = torch.sparse.sampled_addmm: q . K[row] only for the rows each query head needs,
  output = F.embedding_bag(mode="sum", per_sample_weights=softmax(scores)): sum p * V[row],
so K and V are each read once, in place. The row indices depend only on the block tables,
so one plan serves every layer of a forward pass (one per window: a sliding-window layer's
query reads only the last `window` positions of its context).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

# sampled_addmm supports these; other dtypes use the gather + SDPA path.
SUPPORTED_DTYPES = (torch.float32, torch.float64)

with warnings.catch_warnings():
    # torch warns once per process that sparse CSR is "beta"; spend that warning here.
    warnings.simplefilter("ignore", UserWarning)
    torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1), size=(1, 1))


def visible_positions(
    context_lens: torch.Tensor, length: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The context positions each sequence's decode query reads, `length` per sequence:
    (first position [B], padding [B, length] (past the context), positions [B, length] with
    padding at 0). Sequence i reads from max(0, context_len - window) on (0 without a window)."""
    context = context_lens.long()
    first = torch.zeros_like(context) if window is None else (context - window).clamp_(min=0)
    positions = first[:, None] + torch.arange(length, device=context.device)
    padding = positions >= context[:, None]
    return first, padding, positions.masked_fill_(padding, 0)


class SparseDecodePlan:
    """Cache-row indices, CSR layout and padding mask for one decode batch."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
        block_size: int,
        num_kv_heads: int,
        num_heads: int,
        window: int | None = None,
    ):
        """window: the tokens each query sees, itself included (a sliding-window layer's);
        None: its whole context."""
        batch = block_tables.shape[0]
        device = block_tables.device
        group = num_heads // num_kv_heads
        length = max_context_len if window is None else min(max_context_len, window)
        first, padding, positions = visible_positions(context_lens, length, window)
        slots = block_tables.gather(1, torch.div(positions, block_size, rounding_mode="floor")).long() * block_size
        # Padding points at row 0 (always valid); its softmax weight is exactly 0.
        slots = (slots + positions % block_size).masked_fill_(padding, 0)
        kv_head_of = torch.div(torch.arange(num_heads, device=device), group, rounding_mode="floor")
        self.rows = (slots[:, None, :] * num_kv_heads + kv_head_of[None, :, None]).reshape(batch * num_heads, length)
        self.padding = padding[:, None, :].expand(batch, num_heads, length).reshape(batch * num_heads, length)
        num_entries = batch * num_heads * length
        self.crow = torch.arange(0, num_entries + 1, length, device=device)
        self.cols = self.rows.view(-1)
        self._zeros: dict[torch.dtype, torch.Tensor] = {}
        self.batch, self.num_heads, self.length = batch, num_heads, length

    def _zero_values(self, dtype: torch.dtype) -> torch.Tensor:
        zeros = self._zeros.get(dtype)
        if zeros is None:
            zeros = self._zeros[dtype] = torch.zeros(self.cols.numel(), dtype=dtype, device=self.cols.device)
        return zeros

    def attend(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, D] against caches [num_blocks, block_size, Hkv, D] -> [B, Hq, D]."""
        head_dim = q.shape[-1]
        num_rows = key_cache.shape[0] * key_cache.shape[1] * key_cache.shape[2]
        key_table = key_cache.view(num_rows, head_dim)
        value_table = value_cache.view(num_rows, head_dim)
        pattern = torch.sparse_csr_tensor(
            self.crow,
            self.cols,
            self._zero_values(q.dtype),
            size=(self.rows.shape[0], num_rows),
            check_invariants=False,
        )
        scores = (
            torch.sparse.sampled_addmm(pattern, q.reshape(-1, head_dim), key_table.t(), beta=0.0, alpha=scale)
            .values()
            .view(self.rows.shape)
        )
        probs = scores.masked_fill_(self.padding, float("-inf")).softmax(-1)
        out = F.embedding_bag(self.rows, value_table, per_sample_weights=probs, mode="sum")
        return out.view(self.batch, self.num_heads, head_dim)
