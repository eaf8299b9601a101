"""SimulatedKVSender: the prefill side of a simulated engine's KV transfer -- no tensors, the
same protocol (SendJob, its `done` and `flushed` futures, the chaos faults) as KVSender.

One sender thread per replica (kvtransfer/queued_sender.py), as for the real one, so a replica's
transfers queue behind each other whichever pair they go to; each layer (or a packed job whole)
waits its share of SimulatedKVCache.transfer_wall_s: the profile's `kv_link` latency plus bytes
over its bandwidth, slowed speed_factor times. Layer-wise jobs are queued during the prefill step
by its layer callbacks, so the wait overlaps the step's own, as NCCL sends overlap the forward.
"""

from __future__ import annotations

import time

from splitserve.engine.simulated.simulated_kv_cache import SimulatedKVCache
from splitserve.kvtransfer.queued_sender import QueuedSender
from splitserve.kvtransfer.send_job import SendJob


class SimulatedKVSender(QueuedSender):
    kind = "simulated KV"

    def __init__(self, kv_cache: SimulatedKVCache):
        self.kv_cache = kv_cache
        super().__init__(kv_cache.num_layers, "simulated-kv-sender")

    def _flush(self, job: SendJob) -> bool | None:
        # No pair to keep in step: a job that did not fail is flushed at once.
        return None if job.flushed.done() else not (job.failed or self._done_failed(job))

    def _send(self, job: SendJob, layer: int | None) -> None:
        start = time.perf_counter()
        share = 1.0 if layer is None else 1.0 / self.num_layers
        time.sleep(self.kv_cache.transfer_wall_s(len(job.block_ids)) * share)
        job.num_bytes += round(len(job.block_ids) * self.kv_cache.bytes_per_block * share)
        job.num_layers_sent = self.num_layers if layer is None else job.num_layers_sent + 1
        job.seconds += time.perf_counter() - start
        if job.num_layers_sent == self.num_layers:
            self._complete(job)
