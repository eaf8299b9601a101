"""PrefillWorker (a Ray actor): batches prompts, reuses its prefix cache, samples the first
token and sends the KV blocks the decode replica lacks over torch.distributed.

Blocks stay pinned after a transfer until the decode side acknowledges them (ack) or the
lease runs out; then they are unpinned but stay in the prefix cache, evictable.

With Handoff.early_first_token the first token is also pushed to the decode replica
(DecodeWorker.first_token, fire and forget) as soon as it is sampled; the prefill call still
answers once the transfer is done, and only that answer says the KV is whole.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from splitserve.engine.core.scheduler import ScheduledBatch
from splitserve.engine.engine_errors import EngineStepError
from splitserve.engine.engine_protocol import EngineProtocol
from splitserve.engine.io.request_output import RequestOutput
from splitserve.kvtransfer.errors import TransferAbortedError
from splitserve.kvtransfer.protocols import KVSenderProtocol
from splitserve.kvtransfer.send_job import SendJob
from splitserve.proto.messages.handoff import Handoff, PrefillResult
from splitserve.proto.messages.poll_reply import TransferTotals
from splitserve.runtime.engine_worker import EngineWorker
from splitserve.runtime.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


class PrefillWorker(EngineWorker):
    def __init__(self, replica_id: str, worker: WorkerConfig):
        super().__init__(replica_id, worker)
        self.sender: KVSenderProtocol = self.data_plane.make_sender(self.transport, self.engine)
        self._jobs: dict[str, SendJob] = {}
        self._send_indices: dict[str, list[int]] = {}
        self._pinned: dict[str, float] = {}  # request id -> lease deadline (loop thread)
        self._pin_peers: dict[str, str] = {}  # request id -> the decode replica it is pinned for (loop thread)
        self._tasks: dict[str, asyncio.Task] = {}  # request id -> its prefill() call, for cancel()
        self._cancelled: dict[str, float] = {}  # request ids cancelled before their prefill() ran -> when
        self._decode_handles: dict[str, object] = {}  # decode replica id -> its actor (early first tokens)
        self.num_requests = 0
        self.num_failed_transfers = 0
        self.num_blocks_sent = 0
        self.start_loop(layer_hook=self._layer_hook, after_step=self._expire_leases)

    # ---- loop-thread hooks ---------------------------------------------------------------
    def _bind_blocks(self, job: SendJob) -> None:
        job.block_ids = self.engine.prompt_block_ids(job.request_id, self._send_indices[job.request_id])

    def _layer_hook(self, batch: ScheduledBatch):
        completing = []
        for request_id in batch.request_ids_computing_last_token():
            job = self._jobs.get(request_id)
            if job is not None and job.layerwise:
                self._bind_blocks(job)
                completing.append(job)
        return self.sender.layer_callback(completing) if completing else None

    def _expire_leases(self, engine: EngineProtocol) -> None:
        if not self._pinned:
            return
        now = time.monotonic()
        for rid, deadline in list(self._pinned.items()):
            if now >= deadline:
                logger.info("lease of %s expired without an ack; unpinning its blocks", rid)
                self._release(engine, rid)

    def _release(self, engine: EngineProtocol, request_id: str) -> None:
        self._pinned.pop(request_id, None)
        self._pin_peers.pop(request_id, None)
        engine.release_prefilled(request_id)

    def _release_pinned_for(self, engine: EngineProtocol, peer_id: str) -> None:
        for rid in [rid for rid, peer in self._pin_peers.items() if peer == peer_id]:
            logger.info("%s left before acknowledging %s; unpinning its blocks", peer_id, rid)
            self._release(engine, rid)

    def num_pinned(self) -> int:
        return len(self._pinned)

    def transfer_totals(self) -> TransferTotals:
        return TransferTotals(self.num_blocks_sent, self.sender.total_bytes, self.sender.total_seconds)

    # ---- actor methods -------------------------------------------------------------------
    async def transport_address(self) -> tuple[str, int]:
        return self.transport.address

    async def open_pair(self, peer_id: str, epoch: int, peer_address=None) -> None:
        """Open the pair with decode replica peer_id (at peer_address, its transport's), as its
        sender; the peer opens it concurrently. Its actor is looked up now, off the request
        path, for early first tokens."""
        await asyncio.to_thread(self.transport.open_pair, peer_id, peer_address, "sender", epoch)
        if peer_id not in self._decode_handles:
            try:
                handle = await asyncio.to_thread(ray.get_actor, peer_id, namespace=self.namespace)
            except ValueError:  # not a named actor: its first tokens wait for the transfer
                return
            self._decode_handles[peer_id] = handle

    def _push_first_token(self, job: SendJob, result: PrefillResult) -> None:
        """Handoff.early_first_token: the first token to the decode replica now (fire and
        forget: the prefill call's answer follows either way). Not for a transfer already
        failed: its answer, the failure, is on its way."""
        handle = self._decode_handles.get(job.peer_id)
        if handle is None or job.failed or (job.done.done() and job.done.exception() is not None):
            return
        try:
            handle.first_token.remote(job.request_id, result.to_bytes())
        except Exception:  # the peer is gone: the transfer fails too
            pass

    async def prefill(self, handoff_bytes: bytes) -> bytes:
        handoff = Handoff.from_bytes(handoff_bytes)
        rid = handoff.request_id
        if rid in self._jobs:  # ids are the ingress's and unique: never let one clobber another
            raise ValueError(f"request id {rid!r} is already being prefilled on {self.replica_id}")
        params = handoff.sampling
        # A constrained request's grammar is compiled off the engine loop; its mask then
        # applies to the first token, sampled here.
        seq = await self.loop.make_sequence(
            handoff.prompt_token_ids, params, rid, prefill_only=True, deadline=handoff.deadline
        )
        job = SendJob(
            rid,
            handoff.destination,
            handoff.transfer_id,
            [],
            handoff.layerwise,
            num_blocks=len(handoff.send_block_indices),
        )
        if self._cancelled.pop(rid, None) is not None:  # decode gave up before this call ran
            # Its receives are posted: filler for every layer keeps the pair in step.
            await asyncio.wrap_future(self.sender.abort(job))
            raise TransferAbortedError(f"{rid} was cancelled before its prefill started")
        loop = asyncio.get_running_loop()
        first: asyncio.Future[RequestOutput] = loop.create_future()

        def sink(out: RequestOutput | Exception) -> None:  # loop thread, right after the prefill step
            if isinstance(out, Exception):  # its step failed or the loop stopped: blocks already freed
                self.sender.abort(job)  # before the next step may reuse them
                loop.call_soon_threadsafe(lambda: first.done() or first.set_exception(out))
                return
            self._pinned[rid] = time.monotonic() + handoff.lease_s
            self._pin_peers[rid] = job.peer_id
            if not job.layerwise:
                self._bind_blocks(job)
                self.sender.send_all(job)
            loop.call_soon_threadsafe(lambda: first.done() or first.set_result(out))

        self._jobs[rid] = job
        self._send_indices[rid] = list(handoff.send_block_indices)
        self._tasks[rid] = asyncio.current_task()
        self.num_requests += 1
        start = time.perf_counter()
        try:
            await asyncio.wrap_future(self.loop.add_sequence(seq, sink))
            wait_s = None if handoff.deadline is None else max(handoff.deadline - time.time(), 0.1)
            out = await asyncio.wait_for(first, timeout=wait_s)
            prefill_s = time.perf_counter() - start
            if handoff.early_first_token:
                self._push_first_token(job, _result(out, job, prefill_s))
            await asyncio.wait_for(asyncio.wrap_future(job.done), timeout=handoff.lease_s)
        except EngineStepError as exc:  # only this request's batch failed; the pair is shared
            self.num_failed_transfers += 1
            flushed = await asyncio.wait_for(asyncio.wrap_future(job.flushed), timeout=handoff.lease_s)
            if flushed:  # decode's receives all complete: it keeps the pair for the others
                raise TransferAbortedError(str(exc)) from exc
            raise
        except asyncio.CancelledError:  # decode gave the request up (cancel)
            self.num_failed_transfers += 1
            # What was not sent yet goes out as filler, so the pair stays in step for the
            # other transfers on it; then the blocks go.
            self.sender.abort(job)
            await asyncio.shield(asyncio.wrap_future(self.loop.call(lambda e: self._release(e, rid))))
            raise
        except BaseException:
            self.num_failed_transfers += 1
            job.failed = True
            await asyncio.wrap_future(self.loop.call(lambda e: self._release(e, rid)))
            raise
        finally:
            self._jobs.pop(rid, None)
            self._send_indices.pop(rid, None)
            self._tasks.pop(rid, None)
        self.num_blocks_sent += len(job.block_ids)
        return _result(out, job, prefill_s).to_bytes()

    async def cancel(self, request_id: str) -> None:
        """Decode gave the request up (its client left, or it timed out): stop its prefill and
        free its blocks now. A cancel that overtook its prefill() call is remembered, for a
        while, so that call stops at once."""
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()
            return
        now = time.monotonic()
        self._cancelled = {rid: t for rid, t in self._cancelled.items() if now - t < 60.0}
        if request_id not in self._pinned:
            self._cancelled[request_id] = now
        await self.ack(request_id)

    async def ack(self, request_id: str) -> None:
        """Decode has the blocks (or gave up): unpin them now instead of at lease expiry."""
        if self.loop.alive:  # a stopped loop released every block already
            await asyncio.wrap_future(self.loop.call(lambda e: self._release(e, request_id)))

    async def forget_peer(self, peer_id: str, epoch: int | None = None) -> None:
        """EngineWorker.forget_peer. A decode replica that left (no epoch: not an idle pair's
        close) takes nothing more: each transfer to it stops and every block held for it is
        freed now, not when its lease runs out (a dead decode replica never acks)."""
        await super().forget_peer(peer_id, epoch)
        if epoch is not None:
            return
        self._decode_handles.pop(peer_id, None)
        for rid, job in list(self._jobs.items()):
            task = self._tasks.get(rid)
            if job.peer_id == peer_id and task is not None:
                task.cancel()  # its prefill() stops the send and frees the blocks
        if self.loop.alive:
            await asyncio.wrap_future(self.loop.call(lambda e: self._release_pinned_for(e, peer_id)))

    async def inject_fault(self, stall_send_s: float = 0.0, fail_sends: int = 0, **engine_faults) -> None:
        """Chaos testing: stall every KV send by stall_send_s, or fail the next fail_sends;
        engine_faults as EngineWorker.inject_fault (hang_s makes a hung prefill). Each call
        sets every fault (what it does not name is switched off)."""
        self.sender.stall_s = stall_send_s
        self.sender.num_sends_to_fail = fail_sends
        await super().inject_fault(**engine_faults)

    async def shutdown(self) -> None:
        self.loop.stop()
        self.sender.close()  # before the transport it sends on
        await super().shutdown()


def _result(out: RequestOutput, job: SendJob, prefill_s: float) -> PrefillResult:
    """The prefill call's answer: the first token (what rides with it) and the transfer's totals
    (zero in an early first token, sent before the transfer ends)."""
    return PrefillResult(
        request_id=job.request_id,
        first_token=out.new_token_ids[0],
        first_logprob=out.new_logprobs[0] if out.new_logprobs else None,
        first_top_logprobs=out.new_top_logprobs[0] if out.new_top_logprobs else [],
        queue_seconds=out.queue_seconds or 0.0,
        prompt_logprobs=out.prompt_logprobs,
        prompt_top_logprobs=out.prompt_top_logprobs,
        prompt_ranks=out.prompt_ranks,
        num_cached_tokens=out.num_cached_tokens,
        num_blocks_sent=len(job.block_ids) if job.done.done() else 0,
        num_bytes_sent=job.num_bytes if job.done.done() else 0,
        prefill_seconds=prefill_s,
        transfer_seconds=job.seconds if job.done.done() else 0.0,
    )
