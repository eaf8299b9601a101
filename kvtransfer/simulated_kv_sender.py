"""SimulatedKVSender: the prefill side of a simulated engine's KV transfer -- no tensors, the
same protocol (SendJob, its `done` and `flushed` futures, the chaos faults) as KVSender.

One sender thread per replica, as for the real one, so transfers queue behind each other on
the replica's link; each layer (or a packed job whole) waits its share of
SimulatedKVCache.transfer_wall_s: the profile's link latency plus bytes over its bandwidth,
slowed speed_factor times. Layer-wise jobs are queued during the prefill step by its layer
callbacks, so the wait overlaps the step's own, as NCCL sends overlap the forward.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

from splitserve.engine.simulated.simulated_kv_cache import SimulatedKVCache
from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.send_job import SendJob

logger = logging.getLogger(__name__)
_FLUSH = -1  # queue item: an aborted job's remaining layers (nothing to send here)


class SimulatedKVSender:
    def __init__(self, kv_cache: SimulatedKVCache):
        self.kv_cache = kv_cache
        self.num_layers = kv_cache.num_layers
        self._queue: queue.SimpleQueue[tuple[SendJob, int | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="simulated-kv-sender", daemon=True)
        self._thread.start()
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.stall_s = 0.0  # chaos testing, as KVSender's
        self.num_sends_to_fail = 0

    def send_layer(self, job: SendJob, layer: int) -> None:
        self._queue.put((job, layer))

    def send_all(self, job: SendJob) -> None:
        self._queue.put((job, None))

    def abort(self, job: SendJob) -> Future:
        job.aborted = True
        self._queue.put((job, _FLUSH))
        return job.flushed

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, layer = item
            if layer == _FLUSH:
                if not job.flushed.done():
                    # No pair to keep in step: a job that did not fail is flushed at once.
                    done_failed = job.done.done() and not job.done.cancelled() and job.done.exception() is not None
                    job.flushed.set_result(not (job.failed or done_failed))
                continue
            if job.failed or job.aborted or job.done.done():
                continue
            try:
                self._send(job, layer)
            except Exception as exc:
                job.failed = True
                logger.warning("simulated KV send for %s to %s failed: %s", job.request_id, job.peer_id, exc)
                if job.done.set_running_or_notify_cancel():
                    job.done.set_exception(exc)

    def _send(self, job: SendJob, layer: int | None) -> None:
        if self.stall_s:
            time.sleep(self.stall_s)
            if job.failed or job.aborted or job.done.done():
                return
        if self.num_sends_to_fail:
            self.num_sends_to_fail -= 1
            raise TransferError(f"injected send failure for {job.request_id}")
        start = time.perf_counter()
        share = 1.0 if layer is None else 1.0 / self.num_layers
        time.sleep(self.kv_cache.transfer_wall_s(len(job.block_ids)) * share)
        job.num_bytes += round(len(job.block_ids) * self.kv_cache.bytes_per_block * share)
        job.num_layers_sent = self.num_layers if layer is None else job.num_layers_sent + 1
        job.seconds += time.perf_counter() - start
        if job.num_layers_sent == self.num_layers:
            self.total_bytes += job.num_bytes
            self.total_seconds += job.seconds
            if job.done.set_running_or_notify_cancel():
                job.done.set_result(job)
