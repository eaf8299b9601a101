"""What one forward pass needs to know about where tokens live in the paged KV cache."""

from __future__ import annotations

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
