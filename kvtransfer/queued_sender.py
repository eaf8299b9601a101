"""QueuedSender: what every prefill-side KV sender shares -- one sender thread per worker that
takes SendJob layers (or whole jobs) off a queue in the order they were queued, the chaos
faults (stall before each send, fail the next N), and the totals. KVSender (torch.distributed)
and SimulatedKVSender (a timed wait) say only how a layer goes out and how an aborted job is
flushed.

A stall waits on an event, not a sleep: setting stall_s again (a chaos test switching the fault
off) wakes a send stalled now, so a test never has to sleep the stall out.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.send_job import SendJob

logger = logging.getLogger(__name__)

FLUSH = -1  # queue item: an aborted job's remaining layers


class QueuedSender(abc.ABC):
    kind = "KV"  # in log lines

    def __init__(self, num_layers: int, thread_name: str):
        self.num_layers = num_layers
        self.total_bytes = 0
        self.total_seconds = 0.0
        # Fault injection for chaos tests: stall before each send, or fail the next N sends.
        self.num_sends_to_fail = 0
        self._stall_s = 0.0
        self._stall_wake = threading.Event()
        self._queue: queue.SimpleQueue[tuple[SendJob, int | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def stall_s(self) -> float:
        return self._stall_s

    @stall_s.setter
    def stall_s(self, seconds: float) -> None:
        wake, self._stall_wake = self._stall_wake, threading.Event()
        self._stall_s = seconds
        wake.set()  # a send stalled under the old setting goes on now

    def send_layer(self, job: SendJob, layer: int) -> None:
        """Queue one layer of a layer-wise job (called right after the layer is computed)."""
        self._queue.put((job, layer))

    def layer_callback(self, jobs: Sequence[SendJob]) -> Callable[[int], None]:
        """The step's per-layer callback for these layer-wise jobs: each layer queued once computed."""

        def on_layer_done(layer: int) -> None:
            for job in jobs:
                self.send_layer(job, layer)

        return on_layer_done

    def send_all(self, job: SendJob) -> None:
        """Queue a whole job as one item."""
        self._queue.put((job, None))

    def abort(self, job: SendJob) -> Future:
        """The job's prefill failed and its blocks are gone: send nothing more of them, but
        flush it (in queue order, after what was queued). Returns job.flushed."""
        job.aborted = True
        self._queue.put((job, FLUSH))
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
            if layer == FLUSH:
                try:
                    flushed = self._flush(job)
                except Exception:  # never let one job end the thread every transfer goes through
                    logger.exception("%s filler for %s failed", self.kind, job.request_id)
                    flushed = False
                if flushed is not None:
                    self._flushed(job, flushed)
                continue
            if job.failed or job.aborted or job.done.done():
                continue
            try:
                if self._faults_let_through(job):
                    self._send(job, layer)
            except Exception as exc:
                job.failed = True
                logger.warning("%s send for %s to %s failed: %s", self.kind, job.request_id, job.peer_id, exc)
                if job.done.set_running_or_notify_cancel():
                    job.done.set_exception(exc)

    def _faults_let_through(self, job: SendJob) -> bool:
        """Apply the chaos faults before a send: False when the job was given up during a
        stall (its lease ran out: the blocks may be reused); TransferError for a failed send."""
        wake, stall_s = self._stall_wake, self._stall_s
        if stall_s:
            wake.wait(stall_s)
            if job.failed or job.aborted or job.done.done():
                return False
        if self.num_sends_to_fail:
            self.num_sends_to_fail -= 1
            raise TransferError(f"injected send failure for {job.request_id}")
        return True

    @staticmethod
    def _done_failed(job: SendJob) -> bool:
        """done ended in an error (cancelled, when its prefill call stopped waiting, is not one)."""
        return job.done.done() and not job.done.cancelled() and job.done.exception() is not None

    def _complete(self, job: SendJob) -> None:
        """Count a job whose every layer is out, and resolve its done future."""
        self.total_bytes += job.num_bytes
        self.total_seconds += job.seconds
        if job.done.set_running_or_notify_cancel():
            job.done.set_result(job)

    def _flushed(self, job: SendJob, flushed: bool) -> None:
        """Resolve an aborted job's flushed future (True: the pair is in step)."""
        if not job.flushed.done():
            job.flushed.set_result(flushed)

    @abc.abstractmethod
    def _send(self, job: SendJob, layer: int | None) -> None:
        """Send one layer (or, layer None, the whole job)."""

    @abc.abstractmethod
    def _flush(self, job: SendJob) -> bool | None:
        """Finish an aborted job's wire protocol: True once the pair is in step, False if it
        broke, None if the job was flushed already."""
