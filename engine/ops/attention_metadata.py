"""What one forward pass needs to know about where tokens live in the paged KV cache."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """A flattened batch: the new tokens of every scheduled sequence, concatenated.

    Sequence i contributes query tokens [query_start_loc[i], query_start_loc[i+1]) of the
    flattened batch; they sit at the *end* of its context, i.e. at positions
    [context_lens[i] - query_len_i, context_lens[i]). Keys/values for the whole context
    (cached prefix + the new tokens, written first via slot_mapping) are read from the
    paged cache through block_tables.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset per new token
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the model device
    context_lens: torch.Tensor  # int32 [num_seqs]: total tokens (cached + new) after this step
    block_tables: torch.Tensor  # int32 [num_seqs, max_num_blocks], padded with 0
    query_start_loc_cpu: list[int]  # the same as Python ints (avoids device syncs in loops)
    context_lens_cpu: list[int]
    max_query_len: int
    max_context_len: int

    @classmethod
    def build(
        cls,
        slots: list[int],
        query_start: list[int],
        context_lens: list[int],
        tables: list[list[int]],
        max_query_len: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """From Python lists (tables already padded to one width): the tensors on device, the
        lists kept as they are."""
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            query_start_loc_cpu=query_start,
            context_lens_cpu=context_lens,
            max_query_len=max_query_len,
            max_context_len=max(context_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence has exactly one new token (the common decode step)."""
        return self.max_query_len == 1


@dataclass
class OutputRows:
    """The rows of a flattened batch a forward pass reads out (those whose logits are
    computed), for the last layer to finish alone.

    Every row's K/V is needed in every layer, but after the last layer writes its K/V only
    the rows read out matter: their attention, output projection and MLP are all that is left
    to compute (a prompt of T tokens samples from one row, so T - 1 rows' work is skipped).
    Each row attends as a decode query would: one query over its own sequence's context up
    to and including itself (meta, a pure-decode AttentionMetadata with a row per query).
    """

    index: torch.Tensor  # int64 [R]: the rows, in the order the output has them
    meta: AttentionMetadata | None  # None when R == 0 (a prompt chunk that samples nothing)

    @classmethod
    def of(cls, batch: AttentionMetadata, rows: list[int]) -> OutputRows:
        device = batch.slot_mapping.device
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        if not rows:
            return cls(index, None)
        starts = batch.query_start_loc_cpu
        seqs = [bisect.bisect_right(starts, row) - 1 for row in rows]
        # Row r of sequence s is query r - starts[s] of the ones at the end of its context.
        context_lens = [batch.context_lens_cpu[s] - (starts[s + 1] - row) + 1 for row, s in zip(rows, seqs)]
        meta = AttentionMetadata(
            slot_mapping=batch.slot_mapping.index_select(0, index),
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=batch.block_tables.index_select(0, torch.tensor(seqs, device=device)),
            query_start_loc_cpu=list(range(len(rows) + 1)),
            context_lens_cpu=context_lens,
            max_query_len=1,
            max_context_len=max(context_lens),
        )
        return cls(index, meta)
