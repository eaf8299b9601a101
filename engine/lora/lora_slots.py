"""The device's adapter slots: per target module one stacked lora_A [layers, max_loras,
max_lora_rank, in] and lora_B transposed [layers, max_loras, max_lora_rank, out], zero where
an adapter has a smaller rank or does not target the module, so that a batch's tokens index
their adapter's matrices by slot (engine/lora/lora_batch.py) and zeros add nothing."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.lora.peft_checkpoint import LoraAdapter, LoraAdapterError, load_peft_adapter, target_shape

# A token of the base model (no adapter) in a batch's per-token slot index.
NO_ADAPTER = -1


class LoraSlots:
    """max_loras device slots holding adapters by name; each adapter's PEFT scaling per slot."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device):
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.scaling = torch.zeros(max_loras, dtype=dtype, device=self.device)
        self.slot_of: dict[str, int] = {}
        # Targets some loaded adapter has: the others' deltas are all zero and are not computed.
        self.targeted: set[str] = set()

    def _stacks(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's stacked A and B, allocated the first time an adapter targets it."""
        if target not in self.a:
            out_dim, in_dim = target_shape(self.config, target)
            layers, slots, rank = self.config.num_hidden_layers, self.max_loras, self.max_rank
            self.a[target] = torch.zeros(layers, slots, rank, in_dim, dtype=self.dtype, device=self.device)
            # B transposed: a batch's slots' B^T, gathered, is one [slots * rank, out] matrix.
            self.b[target] = torch.zeros(layers, slots, rank, out_dim, dtype=self.dtype, device=self.device)
        return self.a[target], self.b[target]

    def load(self, adapter: LoraAdapter) -> int:
        """Copy an adapter into a free slot; returns the slot."""
        if adapter.name in self.slot_of:
            raise LoraAdapterError(f"LoRA adapter {adapter.name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise LoraAdapterError(f"LoRA adapter {adapter.name!r}: all max_loras={self.max_loras} slots hold adapters")
        slot = free[0]
        for (layer, target), (lora_a, lora_b) in adapter.weights.items():
            a, b = self._stacks(target)
            a[layer, slot, : adapter.rank].copy_(lora_a)
            b[layer, slot, : adapter.rank].copy_(lora_b.T)
        self.scaling[slot] = adapter.scaling
        self.slot_of[adapter.name] = slot
        self.targeted |= adapter.targets
        return slot

    @classmethod
    def from_engine_config(
        cls, engine_config: EngineConfig, config: ModelConfig, dtype: torch.dtype, device
    ) -> LoraSlots:
        """The slots with every adapter of engine_config.lora_modules loaded (one-line refusal
        for one that cannot be served)."""
        slots = cls(config, engine_config.max_loras, engine_config.max_lora_rank, dtype, device)
        modules: Mapping[str, str] = engine_config.lora_modules or {}
        for name, path in modules.items():
            slots.load(load_peft_adapter(name, path, config, engine_config.max_lora_rank))
        return slots
