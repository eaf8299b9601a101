"""RankKVPlane: the KV data plane of one follower rank of a tensor-parallel replica (the
FollowerExtension its engine's ranks run, engine/parallel/follower_extension.py).

Each rank holds its own KV heads of every block, so each moves its own share of a transfer
on pairs of its own: its KVTransport (endpoint `<replica>-rank-<r>`), a KVSender and posted
receives along its routes (head_map.py). The driver (tp_transport.py, tp_sender.py,
tp_receive.py) says what and when (rank_commands.py); this rank answers when it is done:
- prefill: a layer-wise job rides on the forward that computes it, so each layer goes out as
  this rank finishes it, as on the driver; a packed job comes as a command after its step.
- decode: the receives are posted when the command comes, and a thread of this plane waits for
  them (and lands them in the cache) and answers.
Opening pairs blocks until the peer joins, so it runs on this plane's threads too; the
forward loop only ever queues work here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from splitserve.engine.parallel.follower_extension import FollowerContext
from splitserve.kvtransfer.errors import TransferAbortedError, TransferError
from splitserve.kvtransfer.head_map import KVLayout, KVRoute, rank_endpoint, rank_routes
from splitserve.kvtransfer.kv_receiver import PostedReceive
from splitserve.kvtransfer.kv_sender import KVSender
from splitserve.kvtransfer.rank_commands import (
    AbortSend,
    CloseRankPairs,
    InitRank,
    OpenRankPairs,
    RankReceive,
    RankSend,
    RankStats,
    Reply,
    SendLayers,
    SendWhole,
)
from splitserve.kvtransfer.send_job import SendJob
from splitserve.kvtransfer.tp_transport import open_routes
from splitserve.kvtransfer.transport import KVTransport

logger = logging.getLogger(__name__)

_KEEP_JOBS = 1024  # finished jobs remembered, so a late abort knows what they sent
# Threads for pair openings and receive completions: a completion holds one until its transfer
# landed, and a decode replica may have as many in flight as it runs sequences.
_THREADS = 64


class RankKVPlane:
    def __init__(self, context: FollowerContext):
        self.rank = context.rank
        self.kv_cache = context.kv_cache
        self._reply = context.reply
        self.transport: KVTransport | None = None
        self.sender: KVSender | None = None
        self.layout: KVLayout | None = None
        self._routes: dict[str, list[KVRoute]] = {}  # peer replica -> this rank's routes to it
        self._jobs: OrderedDict[tuple[str, int], SendJob] = OrderedDict()
        self._threads = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix=f"rank{self.rank}-kv")

    # ---- FollowerExtension ---------------------------------------------------------------
    def forward_hook(self, work: SendLayers):
        sender = self._require_sender()
        return sender.layer_callback([self._job(spec) for spec in work.jobs])

    def handle(self, command: Any) -> None:
        try:
            self._handle(command)
        except Exception as exc:  # answered, never raised into the forward loop
            number = getattr(command, "number", None)
            if number is None and isinstance(command, SendWhole):
                number = command.job.number
            logger.warning("rank %d: %s failed: %s", self.rank, type(command).__name__, exc)
            if number is not None:
                self._reply(Reply(number, error=str(exc)))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.transport is not None:
            self.transport.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ---- commands ------------------------------------------------------------------------
    def _handle(self, command: Any) -> None:
        if isinstance(command, InitRank):
            self.layout = command.layout
            endpoint = rank_endpoint(command.replica_id, self.rank)
            self.transport = KVTransport(endpoint, self.kv_cache.device, command.host, command.timeout_s)
            self.sender = KVSender(self.transport, self.kv_cache, self._routes_to)
            self._reply(Reply(command.number, self.transport.address))
        elif isinstance(command, OpenRankPairs):
            self._threads.submit(self._open, command)
        elif isinstance(command, CloseRankPairs):
            self._close(command)
        elif isinstance(command, SendWhole):
            self._require_sender().send_all(self._job(command.job))
        elif isinstance(command, AbortSend):
            job = self._job(command.job)
            self._require_sender().abort(job).add_done_callback(lambda flushed: self._flushed(command, job, flushed))
        elif isinstance(command, RankReceive):
            order = command.order
            posted = PostedReceive(
                self._require_transport(),
                self.kv_cache,
                order.peer_id,
                order.transfer_id,
                list(order.block_ids),
                order.layerwise,
                self._routes_to(order.peer_id),
            )
            self._threads.submit(self._complete, command.number, posted)
        elif isinstance(command, RankStats):
            self._reply(Reply(command.number, self._require_transport().stats()))
        else:
            raise TypeError(f"unknown KV command {command!r}")

    def _open(self, command: OpenRankPairs) -> None:
        try:
            transport, layout = self._require_transport(), self.layout
            assert layout is not None  # set with the transport
            routes = rank_routes(layout, command.peer.layout, command.role, self.rank, command.peer_id)
            open_routes(transport, routes, command.peer, command.role, command.epoch)
            self._routes[command.peer_id] = routes
        except Exception as exc:
            self._reply(Reply(command.number, error=str(exc)))
            return
        self._reply(Reply(command.number))

    def _close(self, command: CloseRankPairs) -> None:
        transport = self.transport
        routes = self._routes.get(command.peer_id, [])
        if transport is None:
            return
        for route in routes:
            transport.close_pair(route.endpoint, command.max_epoch)
        if all(not transport.has_pair(route.endpoint) for route in routes):
            self._routes.pop(command.peer_id, None)

    def _complete(self, number: int, posted: PostedReceive) -> None:
        transport = self._require_transport()
        try:
            answer = posted.complete(transport.max_timeout_s)
        except Exception as exc:
            posted.abandon(1.0)
            self._reply(Reply(number, error=str(exc)))
            return
        self._reply(Reply(number, answer))

    # ---- helpers -------------------------------------------------------------------------
    def _job(self, spec: RankSend) -> SendJob:
        """The rank's SendJob for spec (the same one each time it is named); answered once done."""
        key = (spec.peer_id, spec.transfer_id)
        job = self._jobs.get(key)
        if job is None:
            job = SendJob(
                spec.request_id,
                spec.peer_id,
                spec.transfer_id,
                list(spec.block_ids),
                spec.layerwise,
                num_blocks=spec.num_blocks,
            )
            job.done.add_done_callback(lambda done: self._sent(spec.number, job, done))
            self._jobs[key] = job
            while len(self._jobs) > _KEEP_JOBS:
                self._jobs.popitem(last=False)
        return job

    def _flushed(self, command: AbortSend, job: SendJob, flushed: Future) -> None:
        """An aborted job never completes: end it, so its send's answer comes too."""
        try:
            job.done.set_exception(TransferAbortedError(f"{job.request_id} was aborted"))
        except InvalidStateError:
            pass  # it had completed (its last layer was out before the abort)
        self._reply(Reply(command.number, flushed.result()))

    def _sent(self, number: int, job: SendJob, done: Future) -> None:
        if done.cancelled():
            self._reply(Reply(number, error="cancelled"))
        elif done.exception() is not None:
            self._reply(Reply(number, error=str(done.exception())))
        else:
            self._reply(Reply(number, (job.num_bytes, job.seconds)))

    def _routes_to(self, peer_id: str) -> list[KVRoute]:
        routes = self._routes.get(peer_id)
        if routes is None:
            raise TransferError(f"rank {self.rank} has no open pair with {peer_id!r}")
        return routes

    def _require_transport(self) -> KVTransport:
        if self.transport is None:
            raise TransferError(f"rank {self.rank}'s KV plane was not initialised")
        return self.transport

    def _require_sender(self) -> KVSender:
        if self.sender is None:
            raise TransferError(f"rank {self.rank}'s KV plane was not initialised")
        return self.sender
