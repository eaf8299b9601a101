"""The scheduler's limit on a step's LoRA adapters: a step computes the deltas of at most
max_loras distinct adapters (the device's slots, engine/lora/lora_slots.py), and the running
sequences use at most max_loras adapters, so that the slots do not thrash between steps.

A waiting sequence whose adapter would be one too many waits at the head of the queue, and
those behind it wait too (as for KV blocks): the running sequences finish, their adapters'
slots free up, and it is admitted next; nobody passes it, so it is never starved. A running
sequence whose adapter would be one too many in this step (several adapters handed over by
prefill replicas at once) skips the step; the running sequences ahead of it, in the
scheduler's order, finish and it moves up."""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.engine.core.sequence import Sequence


class AdapterLimit:
    """One schedule()'s adapters: those of its step, and those of the running sequences."""

    def __init__(self, max_loras: int | None, running: Iterable[Sequence]):
        """max_loras: None where the engine serves no adapters (no limit)."""
        self.max_loras = max_loras
        self.step: set[str] = set()
        self.running = {seq.params.lora_adapter for seq in running if seq.params.lora_adapter is not None}

    def takes_running(self, seq: Sequence) -> bool:
        """Whether a running sequence may compute in this step (its adapter then counted)."""
        adapter = seq.params.lora_adapter
        if adapter is None or self.max_loras is None or adapter in self.step:
            return True
        if len(self.step) >= self.max_loras:
            return False
        self.step.add(adapter)
        return True

    def takes_waiting(self, seq: Sequence) -> bool:
        """Whether a waiting sequence may be admitted into this step (its adapter then counted)."""
        adapter = seq.params.lora_adapter
        if adapter is None or self.max_loras is None or adapter in self.step:
            return True
        if len(self.step) >= self.max_loras or (adapter not in self.running and len(self.running) >= self.max_loras):
            return False
        self.step.add(adapter)
        self.running.add(adapter)
        return True
