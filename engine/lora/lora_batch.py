"""One step's LoRA: each token's adapter slot, and the per-token delta it adds to a targeted
Linear's output in a batch that mixes adapters and the base model.

The delta is a batched gather matmul (BGMV, as Punica and vLLM call it): each adapter token's
row gathers its slot's lora_A and lora_B out of the stacked slots and multiplies its own
input by them, scaled by its adapter's PEFT scaling. One pass for the whole batch whatever
adapters it mixes -- never a forward per adapter, and the base weights are never merged, so
the base tokens in the same batch compute exactly what they would alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.lora.lora_slots import NO_ADAPTER, LoraSlots

# Adapter tokens per gather: bounds the gathered [tokens, max_lora_rank, width] matrices of a
# long prefill (decode batches are far below it).
GATHER_CHUNK_TOKENS = 256


class LoraBatch:
    """token_slots[t]: the slot of token t's adapter, NO_ADAPTER for a base-model token."""

    def __init__(self, slots: LoraSlots, token_slots: torch.Tensor):
        self.slots = slots
        adapter = token_slots != NO_ADAPTER
        self.rows = adapter.nonzero().squeeze(1)  # the tokens that have an adapter
        self.row_slots = token_slots.index_select(0, self.rows)
        self.every_row = bool(adapter.all())

    @classmethod
    def for_sequences(
        cls, slots: LoraSlots, adapters: Sequence[str | None], num_tokens: Sequence[int]
    ) -> LoraBatch | None:
        """The batch of sequences with these adapters (None: the base) and new-token counts;
        None when no sequence has an adapter, so a base-only step runs as without LoRA."""
        if all(name is None for name in adapters):
            return None
        per_token = [NO_ADAPTER if name is None else slots.slot_of[name] for name in adapters]
        counts = torch.tensor(num_tokens, dtype=torch.int64)
        token_slots = torch.repeat_interleave(torch.tensor(per_token, dtype=torch.int64), counts)
        return cls(slots, token_slots.to(slots.device))

    def add_delta(self, out: torch.Tensor, layer: int, target: str, x: torch.Tensor, first_col: int = 0) -> None:
        """out[:, first_col : first_col + target's out] += each adapter token's
        scaling * lora_B(lora_A(x)), in place (out: the Linear's output, fused or not)."""
        if target not in self.slots.targeted:
            return
        a, b = self.slots.a[target][layer], self.slots.b[target][layer]  # [slots, r, in], [slots, out, r]
        columns = out.narrow(1, first_col, b.shape[1])
        inputs = x if self.every_row else x.index_select(0, self.rows)
        for start in range(0, self.rows.shape[0], GATHER_CHUNK_TOKENS):
            slots = self.row_slots[start : start + GATHER_CHUNK_TOKENS]
            chunk = inputs[start : start + GATHER_CHUNK_TOKENS].unsqueeze(2)  # [t, in, 1]
            shrunk = torch.bmm(a.index_select(0, slots), chunk)  # [t, r, 1]
            delta = torch.bmm(b.index_select(0, slots), shrunk).squeeze(2)  # [t, out]
            delta.mul_(self.slots.scaling.index_select(0, slots).unsqueeze(1))
            if self.every_row:
                columns[start : start + delta.shape[0]].add_(delta)
            else:
                columns.index_add_(0, self.rows[start : start + delta.shape[0]], delta)
