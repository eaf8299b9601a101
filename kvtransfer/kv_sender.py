"""Prefill side of a KV transfer: pack the blocks decode lacks and send them, layer by layer.

A single sender thread per worker keeps sends in the order they were queued; the engine
loop only enqueues (gathering happens here), so transfer overlaps the next layer's compute.
Sends are posted without waiting (packing the next layer overlaps the wire); a job waits for
all of them once, after its last layer. Messages follow splitserve.kvtransfer.wire_layout: blocks that
form one ascending run go out straight from the cache, others are packed first.

A job whose prefill failed (abort) has lost its blocks, but the receiver has posted a receive
for every layer: the layers it had not sent yet go out as zero filler of the same shape, so
those receives complete and the pair -- shared with the other transfers in flight -- stays in
step instead of being torn down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

import torch

from splitserve.engine.ops.block_copy import gather_blocks
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.send_job import SendJob
from splitserve.kvtransfer.wire_layout import ascending_run_start, plane_messages
from splitserve.proto.messages.handoff import layer_tag

logger = logging.getLogger(__name__)


_FLUSH = -1  # queue item: send an aborted job's remaining layers as filler


class KVSender:
    def __init__(self, transport, kv_cache: KVCache):
        self.transport = transport
        self.kv_cache = kv_cache
        self.num_layers = kv_cache.num_layers
        self._queue: queue.SimpleQueue[tuple[SendJob, int | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()
        self.total_bytes = 0
        self.total_seconds = 0.0
        # Fault injection for chaos tests: stall before each send, or fail the next N sends.
        self.stall_s = 0.0
        self.num_sends_to_fail = 0

    def send_layer(self, job: SendJob, layer: int) -> None:
        """Queue one layer of a layer-wise job (called right after the layer is computed)."""
        self._queue.put((job, layer))

    def send_all(self, job: SendJob) -> None:
        """Queue a whole job: every layer layer-wise, or one packed message otherwise."""
        if job.layerwise:
            for layer in range(self.num_layers):
                self._queue.put((job, layer))
        else:
            self._queue.put((job, None))

    def abort(self, job: SendJob) -> Future:
        """The job's prefill failed and its blocks are gone: send nothing more of them, but
        complete the wire protocol with filler (in queue order, after what was queued).
        Returns job.flushed."""
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
                try:
                    self._flush(job)
                except Exception:  # never let one job end the thread every transfer goes through
                    logger.exception("KV filler for %s failed", job.request_id)
                    if not job.flushed.done():
                        job.flushed.set_result(False)
                continue
            if job.failed or job.aborted or job.done.done():
                continue
            try:
                self._send(job, layer)
            except Exception as exc:
                job.failed = True
                logger.warning("KV send for %s to %s failed: %s", job.request_id, job.peer_id, exc)
                if job.done.set_running_or_notify_cancel():
                    job.done.set_exception(exc)

    def _flush(self, job: SendJob) -> None:
        if job.flushed.done():
            return
        # done is cancelled when its prefill call stopped waiting (lease, cancel): not a failure.
        done_failed = job.done.done() and not job.done.cancelled() and job.done.exception() is not None
        if job.failed or done_failed:
            job.flushed.set_result(False)  # its pair broke: nothing keeps it in step now
            return
        try:
            if job.num_blocks and job.num_layers_sent < self.num_layers:
                num_layers = self.num_layers
                planes = self.kv_cache.layer_planes(0)
                shape = (planes.shape[0], job.num_blocks, planes.shape[2])
                messages = list(torch.zeros(shape, dtype=planes.dtype, device=planes.device).unbind(0))
                for layer in range(job.num_layers_sent, num_layers):
                    tag = layer_tag(job.transfer_id, layer if job.layerwise else num_layers, num_layers)
                    job.pending.append(self.transport.isend(job.peer_id, messages, tag))
                for op in job.pending:
                    op.wait()
                job.pending.clear()
                job.num_layers_sent = num_layers
        except Exception as exc:
            job.failed = True
            logger.warning("KV filler for aborted %s to %s failed: %s", job.request_id, job.peer_id, exc)
            job.flushed.set_result(False)
            return
        job.flushed.set_result(True)

    def _send(self, job: SendJob, layer: int | None) -> None:
        if self.stall_s:
            time.sleep(self.stall_s)
            if job.failed or job.aborted or job.done.done():  # its lease ran out meanwhile: the blocks may be reused
                return
        if self.num_sends_to_fail:
            self.num_sends_to_fail -= 1
            raise TransferError(f"injected send failure for {job.request_id}")
        start = time.perf_counter()
        if job.block_ids:
            # A packed job goes out under one tag, but still layer by layer: packing layer i + 1
            # overlaps the wire time of layer i.
            layers = range(self.num_layers) if layer is None else [layer]
            tag = layer_tag(job.transfer_id, self.num_layers if layer is None else layer, self.num_layers)
            run_start = ascending_run_start(job.block_ids)
            for index in layers:
                planes = self.kv_cache.layer_planes(index)
                if run_start is not None:  # pinned until decode acks: send straight from the cache
                    messages = plane_messages(planes, run_start, len(job.block_ids))
                else:
                    messages = list(gather_blocks(planes, job.block_ids).unbind(0))
                op = self.transport.isend(job.peer_id, messages, tag)
                job.pending.append(op)
                job.num_bytes += op.num_bytes
        job.num_layers_sent = self.num_layers if layer is None else job.num_layers_sent + 1
        finished = job.num_layers_sent == self.num_layers
        if finished:
            for op in job.pending:  # in posting order; a failure raises TransferError
                op.wait()
            job.pending.clear()
        job.seconds += time.perf_counter() - start
        if finished:
            self.total_bytes += job.num_bytes
            self.total_seconds += job.seconds
            if job.done.set_running_or_notify_cancel():
                job.done.set_result(job)
