"""Prefill side of a KV transfer: pack the blocks decode lacks and send them, layer by layer.

A single sender thread per worker (kvtransfer/queued_sender.py) keeps sends in the order they
were queued; the engine loop only enqueues (gathering happens here), so transfer overlaps the next layer's compute.
Sends are posted without waiting (packing the next layer overlaps the wire); a job waits for
all of them once, after its last layer. Messages follow splitserve.kvtransfer.wire_layout: blocks that
form one ascending run go out straight from the cache, others are packed first.

One rank's sender: each job goes along this rank's routes to the job's peer replica (routes,
head_map.py): with both ends at TP 1 (or equal sizes) one whole route to the peer's rank, else
a slice of this rank's KV heads to each decode rank that keeps them (head_slices.py).

A job whose prefill failed (abort) has lost its blocks, but the receiver has posted a receive
for every layer: the layers it had not sent yet go out as zero filler of the same shape, so
those receives complete and the pair -- shared with the other transfers in flight -- stays in
step instead of being torn down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.head_map import KVRoute
from splitserve.kvtransfer.head_slices import filler_messages, send_messages, whole_route
from splitserve.kvtransfer.queued_sender import QueuedSender
from splitserve.kvtransfer.send_job import SendJob
from splitserve.kvtransfer.wire_layout import ascending_run_start
from splitserve.proto.messages.handoff import layer_tag

logger = logging.getLogger(__name__)

# A peer replica's id -> this rank's routes to it.
Routes = Callable[[str], Sequence[KVRoute]]


class KVSender(QueuedSender):
    def __init__(self, transport, kv_cache: KVCache, routes: Routes | None = None):
        """routes: this rank's routes to a peer (default: one whole route to the peer itself)."""
        self.transport = transport
        self.kv_cache = kv_cache
        self.routes: Routes = routes or (lambda peer_id: [whole_route(peer_id, kv_cache)])
        super().__init__(kv_cache.num_layers, "kv-sender")

    def send_all(self, job: SendJob) -> None:
        """Queue a whole job: every layer layer-wise, or one packed message otherwise."""
        if job.layerwise:
            for layer in range(self.num_layers):
                self.send_layer(job, layer)
        else:
            super().send_all(job)

    def _flush(self, job: SendJob) -> bool | None:
        if job.flushed.done():
            return None
        if job.failed or self._done_failed(job):
            return False  # its pair broke: nothing keeps it in step now
        try:
            if job.num_blocks and job.num_layers_sent < self.num_layers:
                num_layers = self.num_layers
                fillers = [
                    (route, filler_messages(self.kv_cache, route, job.num_blocks)) for route in self.routes(job.peer_id)
                ]
                for layer in range(job.num_layers_sent, num_layers):
                    tag = layer_tag(job.transfer_id, layer if job.layerwise else num_layers, num_layers)
                    for route, messages in fillers:
                        job.pending.append(self.transport.isend(route.endpoint, messages, tag))
                for op in job.pending:
                    op.wait()
                job.pending.clear()
                job.num_layers_sent = num_layers
        except Exception as exc:
            job.failed = True
            logger.warning("KV filler for aborted %s to %s failed: %s", job.request_id, job.peer_id, exc)
            return False
        return True

    def _send(self, job: SendJob, layer: int | None) -> None:
        start = time.perf_counter()
        if job.block_ids:
            # A packed job goes out under one tag, but still layer by layer: packing layer i + 1
            # overlaps the wire time of layer i.
            layers = range(self.num_layers) if layer is None else [layer]
            tag = layer_tag(job.transfer_id, self.num_layers if layer is None else layer, self.num_layers)
            run_start = ascending_run_start(job.block_ids)
            ids = torch.tensor(job.block_ids, dtype=torch.int64, device=self.kv_cache.device)
            routes = self.routes(job.peer_id)
            for index in layers:
                for route in routes:
                    messages = send_messages(self.kv_cache, index, route, ids, run_start)
                    op = self.transport.isend(route.endpoint, messages, tag)
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
            self._complete(job)
