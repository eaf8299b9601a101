"""Turns a scheduled batch into tensors, runs the model and samples. The only place the
colocated engine and the workers touch tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.engine.core.scheduler import ScheduledBatch
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.sample.grammar_mask import GrammarMask
from splitserve.engine.sample.sampler import SampledToken, Sampler


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, seed: int = 0, eos_token_ids: list[int] | tuple[int, ...] = ()
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.device
        self.sampler = Sampler(seed, eos_token_ids)
        self.grammar_mask = GrammarMask(model.config.vocab_size)

    def build_metadata(
        self, seqs: list[Sequence], num_new_tokens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input ids, positions, attention metadata, and the flat index of each sequence's
        last new token (where logits are read)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        num_tokens = 0
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            table = seq.block_table
            if n == 1:  # a decode step: skip the slicing and ranges of the general case
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                end = start + n
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            num_tokens += n
            query_start.append(num_tokens)
            context_lens.append(start + n)
            tables.append(table)
        last_index = [q - 1 for q in query_start[1:]]
        max_blocks = -(-max(context_lens) // bs)
        # Each row: the first max_blocks entries of the sequence's table, zero-padded.
        tables = [t[:max_blocks] if len(t) >= max_blocks else t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_start_loc_cpu=query_start,
            context_lens_cpu=context_lens,
            max_query_len=max(num_new_tokens),
            max_context_len=max(context_lens),
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            last_index,
        )

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, on_layer_done: Callable[[int], None] | None = None
    ) -> dict[str, SampledToken]:
        """Run one step; returns the sampled token for each sequence that reached its end."""
        if batch.is_empty:
            return {}
        input_ids, positions, meta, last_index = self.build_metadata(batch.seqs, batch.num_new_tokens)
        rows, seqs = [], []
        for seq, n, idx in zip(batch.seqs, batch.num_new_tokens, last_index):
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(idx)
                seqs.append(seq)
        self.grammar_mask.start(seqs)  # constrained rows' masks are computed during the forward
        hidden = self.model(input_ids, positions, self.kv_cache, meta, on_layer_done=on_layer_done)
        if not rows:
            return {}
        if len(rows) == hidden.shape[0]:
            selected = hidden
        else:
            selected = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
        logits = self.grammar_mask.apply(self.model.compute_logits(selected))
        # Prefill-only sequences (disaggregated prefill) take this same path: the first token
        # gets the request's grammar mask, penalties, logit_bias and min_tokens like every later one.
        results = self.sampler.sample(logits, seqs)
        self.grammar_mask.accept(seqs, [token for token, _, _ in results])
        return {s.request_id: r for s, r in zip(seqs, results)}

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
