"""The device's adapter slots: per fused projection of the decoder layer (PROJECTION_GROUPS)
one stacked lora_A, transposed and side by side over the group's targets, [layers, max_loras,
in, targets * max_lora_rank], and per target one lora_B transposed [layers, max_loras,
max_lora_rank, out]; zero where an adapter has a smaller rank or does not target the module,
so that a batch's tokens index their adapter's matrices by slot (engine/lora/lora_batch.py)
and zeros add nothing. The group's A side by side is one shrink matmul for q, k and v (and for
gate and up) where each target's own would be three (two) smaller ones.

A replica serves more adapters than slots: each lives in the host tier
(engine/lora/lora_host_cache.py) and is copied into a slot when a step needs it, evicting the
least recently used slot whose adapter the step does not use (one no running sequence uses
first). The scheduler never schedules a step of more than max_loras adapters
(engine/core/lora_admission.py), so a step always finds its slots."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.lora.lora_host_cache import LoraHostCache
from splitserve.engine.lora.lora_load_stats import LoraLoadStats
from splitserve.engine.lora.peft_checkpoint import LoraAdapter, LoraAdapterError, target_shape
from splitserve.engine.model_config import ModelConfig

# A token of the base model (no adapter) in a batch's per-token slot index.
NO_ADAPTER = -1
# The decoder layer's projections (engine/model/layers.py), each with the targets whose outputs
# are its output's column ranges, in order.
PROJECTION_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
GROUP_OF = {target: group for group, targets in PROJECTION_GROUPS.items() for target in targets}


class LoraSlots:
    """max_loras device slots holding adapters by name; each adapter's PEFT scaling per slot.
    slot_of: the resident adapters, least recently used first."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device, host=None):
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.stats = LoraLoadStats() if host is None else host.stats
        self.host: LoraHostCache = host or LoraHostCache(config, max_rank, max_loras, self.stats)
        # a_t[group]: the group's stacked A transposed; a[target]: its target's [layers, slots,
        # rank, in] view of it (what an adapter is copied into); b[target]: B transposed.
        self.a_t: dict[str, torch.Tensor] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.scaling = torch.zeros(max_loras, dtype=dtype, device=self.device)
        self.slot_scaling = [0.0] * max_loras  # the same on the host: a step's layout reads it
        # Per projection group, per target: (its first column in the group's output, its width).
        self.columns: dict[str, list[tuple[str, int, int]]] = {}
        for group, targets in PROJECTION_GROUPS.items():
            widths = [target_shape(config, target)[0] for target in targets]
            firsts = [sum(widths[:i]) for i in range(len(widths))]
            self.columns[group] = list(zip(targets, firsts, widths))
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        # Targets some loaded adapter has: the others' deltas are all zero and are not computed.
        self.targeted: set[str] = set()
        # acquire runs on the thread running the forwards, register and unload on the engine
        # loop's: one at a time over slot_of and the host cache.
        self.lock = threading.Lock()

    def _stacks(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's A (a view of its group's) and B, allocated the first time an adapter
        targets it (its group's A then for all the group's targets)."""
        layers, slots, rank = self.config.num_hidden_layers, self.max_loras, self.max_rank
        group = GROUP_OF[target]
        if group not in self.a_t:
            targets = PROJECTION_GROUPS[group]
            in_dim = target_shape(self.config, target)[1]  # a group's targets share their input
            shape = (layers, slots, in_dim, len(targets) * rank)
            self.a_t[group] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            for i, name in enumerate(targets):
                self.a[name] = self.a_t[group][..., i * rank : (i + 1) * rank].transpose(2, 3)
        if target not in self.b:
            out_dim = target_shape(self.config, target)[0]
            # B transposed: a token's shrunk [rank] row times it is its [out] delta.
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
        start = time.perf_counter()
        # The slot's previous adapter may have had a larger rank or other targets: zero it all.
        for stacked in (*self.a_t.values(), *self.b.values()):
            stacked[:, slot].zero_()
        for (layer, target), (lora_a, lora_b) in adapter.weights.items():
            a, b = self._stacks(target)
            a[layer, slot, : adapter.rank].copy_(lora_a)
            b[layer, slot, : adapter.rank].copy_(lora_b.T)
        self.scaling[slot] = adapter.scaling
        self.slot_scaling[slot] = adapter.scaling
        self.slot_of[adapter.name] = slot
        self.targeted |= adapter.targets
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies done, so the seconds are the load's
        self.stats.loaded("device", time.perf_counter() - start)
        return slot

    def evict(self, name: str) -> None:
        """Free the adapter's slot (its host copy stays in the host tier)."""
        self.slot_of.pop(name)
        self.stats.evicted("device")

    def acquire(self, names: Collection[str], keep: Collection[str] = ()) -> None:
        """Make every adapter of names resident (a step's adapters, at most max_loras), each
        the most recently used now. A missing one takes a free slot, or evicts the least
        recently used adapter not in names, preferring one not in keep (the running sequences')."""
        if len(set(names)) > self.max_loras:
            raise LoraAdapterError(f"a step of {len(set(names))} LoRA adapters but max_loras={self.max_loras}")
        with self.lock:
            self._acquire(names, keep)

    def _acquire(self, names: Collection[str], keep: Collection[str]) -> None:
        for name in names:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
        for name in names:
            if name in self.slot_of:
                continue
            if len(self.slot_of) == self.max_loras:
                idle = [n for n in self.slot_of if n not in names]  # least recently used first
                victim = next((n for n in idle if n not in keep), idle[0])
                self.evict(victim)
            self.load(self.host.get(name))

    def register(self, name: str, path: str) -> None:
        """Serve another adapter (at runtime): read and checked now, a one-line
        LoraAdapterError if it cannot be served; it takes a slot when a step needs it."""
        with self.lock:
            self.host.register({name: path})

    def unload(self, name: str) -> None:
        """Stop serving the adapter: out of its slot and the host tier (no request uses it)."""
        with self.lock:
            if name in self.slot_of:
                self.evict(name)
            self.host.unregister(name)

    def residency(self) -> dict[str, list[str]]:
        """EngineStats' lora_device_adapters and lora_host_adapters (each sorted)."""
        return {
            "lora_device_adapters": sorted(self.slot_of),
            "lora_host_adapters": sorted(self.host.cached),
        }

    @classmethod
    def from_engine_config(
        cls, engine_config: EngineConfig, config: ModelConfig, dtype: torch.dtype, device
    ) -> LoraSlots:
        """Every adapter of engine_config.lora_modules read and checked (one-line refusal for
        one that cannot be served), the first max_cpu_loras kept in the host cache and the
        first max_loras copied into the device's slots."""
        rank = engine_config.max_lora_rank
        stats = LoraLoadStats()
        host = LoraHostCache(config, rank, engine_config.max_cpu_loras or engine_config.max_loras, stats)
        slots = cls(config, engine_config.max_loras, rank, dtype, device, host)
        modules: Mapping[str, str] = engine_config.lora_modules or {}
        host.register(modules)
        slots.acquire(list(modules)[: slots.max_loras])
        return slots
