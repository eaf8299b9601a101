"""Prefill side of a KV transfer: pack the blocks decode lacks and send them, layer by layer.

A single sender thread per worker keeps sends in the order they were queued; the engine
loop only enqueues (gathering happens here), so transfer overlaps the next layer's compute.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.block_copy import gather_blocks
from engine.kv_cache import KVCache
from kvtransfer.errors import TransferError
from kvtransfer.handoff import layer_tag

logger = logging.getLogger(__name__)


@dataclass
class SendJob:
    """One request's transfer: which local blocks go to which peer under which tags."""

    request_id: str
    peer_id: str
    transfer_id: int
    block_ids: list[int]              # prefill-side block ids, in the order decode expects
    layerwise: bool
    done: Future = field(default_factory=Future)
    num_layers_sent: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    failed: bool = False


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

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, layer = item
            if job.failed or job.done.done():
                continue
            try:
                self._send(job, layer)
            except Exception as exc:
                job.failed = True
                logger.warning("KV send for %s to %s failed: %s", job.request_id, job.peer_id, exc)
                if job.done.set_running_or_notify_cancel():
                    job.done.set_exception(exc)

    def _send(self, job: SendJob, layer: int | None) -> None:
        if self.stall_s:
            time.sleep(self.stall_s)
        if self.num_sends_to_fail:
            self.num_sends_to_fail -= 1
            raise TransferError(f"injected send failure for {job.request_id}")
        start = time.perf_counter()
        if job.block_ids:
            if layer is None:
                planes = self.kv_cache.kv.view(2 * self.num_layers, self.kv_cache.num_blocks, -1)
                tag = layer_tag(job.transfer_id, self.num_layers, self.num_layers)
            else:
                planes = self.kv_cache.layer_planes(layer)
                tag = layer_tag(job.transfer_id, layer, self.num_layers)
            staging = gather_blocks(planes, job.block_ids)
            self.transport.send(job.peer_id, [staging], tag)
            job.num_bytes += staging.numel() * staging.element_size()
        job.seconds += time.perf_counter() - start
        job.num_layers_sent = self.num_layers if layer is None else job.num_layers_sent + 1
        if job.num_layers_sent == self.num_layers:
            self.total_bytes += job.num_bytes
            self.total_seconds += job.seconds
            if job.done.set_running_or_notify_cancel():
                job.done.set_result(job)

