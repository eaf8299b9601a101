"""SimulatedReceive: the decode side of a simulated KV transfer. The prefill replica answers
only once its SimulatedKVSender waited the transfer out, so by then the blocks "arrived":
complete() reports their bytes at once; nothing is ever left posted to abandon."""

from __future__ import annotations

import time

from splitserve.engine.simulated.simulated_kv_cache import SimulatedKVCache


class SimulatedReceive:
    def __init__(self, kv_cache: SimulatedKVCache, block_ids: list[int]):
        self.num_bytes = len(block_ids) * kv_cache.bytes_per_block
        self._start = time.perf_counter()

    def complete(self, timeout_s: float) -> tuple[int, float]:
        return self.num_bytes, time.perf_counter() - self._start

    def abandon(self, timeout_s: float) -> None:
        return None
