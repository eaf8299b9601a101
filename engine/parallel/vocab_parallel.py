"""The vocabulary-parallel ends of the sharded model: the embedding lookup and the logits.

Each rank holds ShardPlan.vocab_rows rows of lm_head and of the embedding (the same rows when
they are tied; a small untied embedding is held whole instead, ShardPlan.replicated_embedding,
and looked up as the unsharded model does). The embedding looks up the ids in its rows, zeroes the others and all-reduces:
one rank contributes each row and the rest add exact zeros, so the result is bitwise the
unsharded lookup. The logits are gathered to the driver only, not all-gathered: only rank 0
samples (and it broadcasts nothing back: the next step's batch carries the token), so the other
ranks would receive the full vocabulary's logits for nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.parallel.tp_group import TensorParallelGroup


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """input_ids [T] over the whole vocabulary -> hidden [T, hidden], the same on every rank."""
    local = input_ids - group.plan.vocab_start
    outside = (local < 0) | (local >= group.plan.vocab_rows_loaded)
    hidden = F.embedding(local.masked_fill(outside, 0), weight)
    hidden.masked_fill_(outside.unsqueeze(1), 0)
    return group.all_reduce(hidden)


def gather_vocab_logits(local_logits: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor | None:
    """[N, vocab_rows] per rank -> [N, vocab] on the driver (padding rows cut); None elsewhere."""
    parts = group.gather_to_driver(local_logits.contiguous())
    if parts is None:
        return None
    return torch.cat(parts, dim=1)[:, : group.plan.config.vocab_size]
