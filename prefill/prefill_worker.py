"""PrefillWorker (a Ray actor): batches prompts, reuses its prefix cache, samples the first
token and sends the KV blocks the decode replica lacks over torch.distributed.

Blocks stay pinned after a transfer until the decode side acknowledges them (ack) or the
lease runs out; then they are unpinned but stay in the prefix cache, evictable.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.scheduler import ScheduledBatch
from splitserve.engine.core.sequence import SequenceStatus
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kvtransfer.handoff import Handoff, PrefillResult
from splitserve.kvtransfer.kv_sender import KVSender, SendJob
from splitserve.kvtransfer.transport import KVTransport, resolve_host

logger = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(
        self,
        replica_id: str,
        engine_config: dict,
        transport_host: str = "127.0.0.1",
        transfer_timeout_s: float = 20.0,
        torch_threads: int | None = None,
    ):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.replica_id = replica_id
        self.engine = LLMEngine(EngineConfig(**engine_config))
        self.transport = KVTransport(
            replica_id, self.engine.kv_cache.device, host=resolve_host(transport_host), timeout_s=transfer_timeout_s
        )
        self.sender = KVSender(self.transport, self.engine.kv_cache)
        self._jobs: dict[str, SendJob] = {}
        self._send_indices: dict[str, list[int]] = {}
        self._pinned: dict[str, float] = {}  # request id -> lease deadline (loop thread)
        self.num_requests = 0
        self.num_failed_transfers = 0
        self.loop = EngineLoop(self.engine, layer_hook=self._layer_hook, after_step=self._expire_leases).start()

    # ---- loop-thread hooks ---------------------------------------------------------------
    def _bind_blocks(self, job: SendJob) -> None:
        seq = self.engine.scheduler.requests[job.request_id]
        job.block_ids = [seq.block_table[i] for i in self._send_indices[job.request_id]]

    def _layer_hook(self, batch: ScheduledBatch):
        completing = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            job = self._jobs.get(seq.request_id)
            if job is not None and job.layerwise and seq.num_computed_tokens + num_new == seq.num_tokens:
                self._bind_blocks(job)
                completing.append(job)
        if not completing:
            return None

        def on_layer_done(layer: int) -> None:
            for job in completing:
                self.sender.send_layer(job, layer)

        return on_layer_done

    def _expire_leases(self, engine: LLMEngine) -> None:
        if not self._pinned:
            return
        now = time.monotonic()
        for rid, deadline in list(self._pinned.items()):
            if now >= deadline:
                logger.info("lease of %s expired without an ack; unpinning its blocks", rid)
                self._release(engine, rid)

    def _release(self, engine: LLMEngine, request_id: str) -> None:
        self._pinned.pop(request_id, None)
        seq = engine.scheduler.requests.get(request_id)
        if seq is None:
            return
        if seq.status is SequenceStatus.PREFILLED:
            engine.scheduler.release_prefilled(seq)
        else:
            engine.abort(request_id)

    # ---- actor methods -------------------------------------------------------------------
    async def ready(self) -> str:
        return self.replica_id

    async def transport_address(self) -> tuple[str, int]:
        return self.transport.address

    async def connect(self, peer_id: str, epoch: int) -> None:
        """Join the (this prefill, peer decode) process group; the peer joins concurrently."""
        await asyncio.to_thread(self.transport.open_pair, peer_id, None, "sender", epoch)

    async def prefill(self, handoff_bytes: bytes) -> bytes:
        handoff = Handoff.from_bytes(handoff_bytes)
        rid = handoff.request_id
        params = SamplingParams.from_dict(handoff.sampling)
        seq = self.engine.make_sequence(None, handoff.prompt_token_ids, params, rid, prefill_only=True)
        job = SendJob(rid, handoff.destination, handoff.transfer_id, [], handoff.layerwise)
        loop = asyncio.get_running_loop()
        first: asyncio.Future[RequestOutput] = loop.create_future()

        def sink(out: RequestOutput) -> None:  # loop thread, right after the prefill step
            self._pinned[rid] = time.monotonic() + handoff.lease_s
            if not job.layerwise:
                self._bind_blocks(job)
                self.sender.send_all(job)
            loop.call_soon_threadsafe(lambda: first.done() or first.set_result(out))

        self._jobs[rid] = job
        self._send_indices[rid] = list(handoff.send_block_indices)
        self.num_requests += 1
        start = time.perf_counter()
        try:
            await asyncio.wrap_future(self.loop.add_sequence(seq, sink))
            wait_s = None if handoff.deadline is None else max(handoff.deadline - time.time(), 0.1)
            out = await asyncio.wait_for(first, timeout=wait_s)
            prefill_s = time.perf_counter() - start
            await asyncio.wait_for(asyncio.wrap_future(job.done), timeout=handoff.lease_s)
        except BaseException:
            self.num_failed_transfers += 1
            job.failed = True
            await asyncio.wrap_future(self.loop.call(lambda e: self._release(e, rid)))
            raise
        finally:
            self._jobs.pop(rid, None)
            self._send_indices.pop(rid, None)
        return PrefillResult(
            request_id=rid,
            first_token=out.new_token_ids[0],
            first_logprob=out.new_logprobs[0] if out.new_logprobs else None,
            first_top_logprobs=[list(pair) for pair in out.new_top_logprobs[0]] if out.new_top_logprobs else [],
            queue_seconds=out.queue_seconds or 0.0,
            num_cached_tokens=out.num_cached_tokens,
            num_blocks_sent=len(job.block_ids),
            num_bytes_sent=job.num_bytes,
            prefill_seconds=prefill_s,
            transfer_seconds=job.seconds,
        ).to_bytes()

    async def ack(self, request_id: str) -> None:
        """Decode has the blocks (or gave up): unpin them now instead of at lease expiry."""
        await asyncio.wrap_future(self.loop.call(lambda e: self._release(e, request_id)))

    async def poll(self) -> dict:
        """KV events since the last poll plus load figures, for the router."""

        def collect(engine: LLMEngine) -> dict:
            stats = engine.stats()
            stats["num_pinned"] = len(self._pinned)
            return {"events": [ev.to_wire() for ev in engine.kv.take_events()], "load": stats}

        result = await asyncio.wrap_future(self.loop.call(collect))
        result["transfer"] = {"bytes": self.sender.total_bytes, "seconds": self.sender.total_seconds}
        return result

    async def snapshot(self) -> tuple[int, list[int]]:
        return await asyncio.wrap_future(self.loop.call(lambda e: e.kv.snapshot()))

    async def inject_fault(self, stall_send_s: float = 0.0, fail_sends: int = 0) -> None:
        """Chaos testing: stall every KV send by stall_send_s, or fail the next fail_sends."""
        self.sender.stall_s = stall_send_s
        self.sender.num_sends_to_fail = fail_sends

    async def forget_peer(self, decode_id: str) -> None:
        """The decode replica closed (or lost) its side of the pair: close ours too."""
        await asyncio.to_thread(self.transport.close_pair, decode_id)

    async def shutdown(self) -> None:
        self.loop.stop()
        self.sender.close()
        self.transport.close()
