"""The host tier of a replica's adapters: every adapter it serves, by name and directory, and
an LRU cache of up to max_cpu_loras of them read into host memory (vLLM's --max-cpu-loras).
A miss reads the adapter from its directory again (engine/lora/peft_checkpoint.py), so a
replica serves any number of adapters with bounded host memory; the device's slots
(engine/lora/lora_slots.py) copy from here."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping

from splitserve.engine.lora.lora_load_stats import LoraLoadStats
from splitserve.engine.lora.peft_checkpoint import LoraAdapter, LoraAdapterError, load_peft_adapter
from splitserve.engine.model_config import ModelConfig


class LoraHostCache:
    """paths: the served adapters (name -> directory); cached: up to capacity of them read,
    least recently used first."""

    def __init__(self, config: ModelConfig, max_rank: int, capacity: int, stats: LoraLoadStats):
        self.config = config
        self.max_rank = max_rank
        self.capacity = capacity
        self.stats = stats
        self.paths: dict[str, str] = {}
        self.cached: OrderedDict[str, LoraAdapter] = OrderedDict()

    def register(self, modules: Mapping[str, str]) -> None:
        """Serve these adapters: each read now (a one-line LoraAdapterError for one that cannot
        be served, before any is registered) and kept in the cache while it has room (none is
        evicted for a later one: the first are those the device's slots start with)."""
        adapters = [self._read(name, path) for name, path in modules.items()]
        for adapter in adapters:
            self.paths[adapter.name] = modules[adapter.name]
            if len(self.cached) < self.capacity:
                self.cached[adapter.name] = adapter

    def unregister(self, name: str) -> None:
        self.paths.pop(name, None)
        self.cached.pop(name, None)

    def get(self, name: str) -> LoraAdapter:
        """The adapter's host copy: the cached one (now the most recently used) or, on a miss,
        read again from its directory."""
        adapter = self.cached.get(name)
        if adapter is not None:
            self.cached.move_to_end(name)
            return adapter
        if name not in self.paths:
            raise LoraAdapterError(f"unknown LoRA adapter {name!r}")
        adapter = self._read(name, self.paths[name])
        self._insert(adapter)
        return adapter

    def _read(self, name: str, path: str) -> LoraAdapter:
        start = time.perf_counter()
        adapter = load_peft_adapter(name, path, self.config, self.max_rank)
        self.stats.loaded("host", time.perf_counter() - start)
        return adapter

    def _insert(self, adapter: LoraAdapter) -> None:
        self.cached[adapter.name] = adapter
        self.cached.move_to_end(adapter.name)
        while len(self.cached) > self.capacity:
            self.cached.popitem(last=False)
            self.stats.evicted("host")
