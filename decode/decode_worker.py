"""DecodeWorker (a Ray actor): reserves blocks for a prompt, pulls the ones it lacks from a
prefill replica over torch.distributed, then runs the request in its continuous batch and
streams tokens. With no prefill replica given it prefills locally (conditional
disaggregation, and the colocated mode)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import ray

from splitserve.engine.core.sequence import Sequence
from splitserve.engine.engine_errors import EngineLoopStopped
from splitserve.engine.io.block_reservation import BlockReservation
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.kvtransfer.engine_worker import EngineWorker
from splitserve.kvtransfer.errors import TransferAbortedError
from splitserve.kvtransfer.handoff import DecodeRequest, Handoff, PrefillResult, StreamChunk
from splitserve.kvtransfer.kv_receiver import PostedReceive
from splitserve.kvtransfer.poll_reply import TransferTotals

logger = logging.getLogger(__name__)


class PrefillFailedError(RuntimeError):
    """The remote prefill or the KV transfer failed; no token reached the client, so the
    frontend may retry on another prefill replica."""


class PrefillReplicaDeadError(PrefillFailedError):
    """The prefill replica is gone: its actor died or its engine loop stopped. Not the
    request's fault, so a retry elsewhere does not count against its budget."""


class ReplicaBusyError(RuntimeError):
    """No KV blocks came free for the prompt in time."""


class DecodeWorker(EngineWorker):
    def __init__(
        self,
        replica_id: str,
        engine_config: dict,
        transport_host: str = "127.0.0.1",
        transfer_timeout_s: float = 20.0,
        torch_threads: int | None = None,
        reserve_timeout_s: float = 30.0,
    ):
        super().__init__(replica_id, engine_config, transport_host, transfer_timeout_s, torch_threads)
        self.reserve_timeout_s = reserve_timeout_s
        self._epochs: dict[str, int] = {}
        self._open_pairs: set[str] = set()
        self._pair_locks: dict[str, asyncio.Lock] = {}
        self._transfer_ids = itertools.count(1)
        self.num_blocks_received = 0
        self.num_bytes_received = 0
        self.transfer_seconds = 0.0
        self.start_loop()

    # ---- streaming generation ------------------------------------------------------------
    async def generate(self, request_bytes: bytes, prefill=None, prefill_id: str | None = None):
        """Async generator of StreamChunk bytes. prefill: a PrefillWorker handle, or None to
        prefill locally."""
        req = DecodeRequest.from_bytes(request_bytes)
        params = SamplingParams.from_dict(req.sampling)
        seq = await self.loop.make_sequence(req.prompt_token_ids, params, req.request_id, deadline=req.deadline)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()

        def sink(out: RequestOutput | Exception) -> None:  # engine loop thread
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        finished = False
        first_chunk = True
        self.num_active += 1
        try:
            if prefill is None:
                await asyncio.wrap_future(self.loop.add_sequence(seq, sink))
            else:
                first = await self._remote_prefill(seq, req, prefill, prefill_id)
                await asyncio.wrap_future(
                    self.loop.admit_prefilled(
                        seq.request_id,
                        first.first_token,
                        first.first_logprob,
                        first.num_cached_tokens,
                        sink,
                        first.first_top_logprobs,
                        first.queue_seconds,
                    )
                )
            while not finished:
                timeout = None if req.deadline is None else max(req.deadline - time.time(), 0.01)
                out = await asyncio.wait_for(outputs.get(), timeout=timeout)
                if isinstance(out, Exception):  # its step failed (EngineStepError) or the loop stopped
                    raise out
                finished = out.finished
                yield StreamChunk(
                    request_id=out.request_id,
                    token_ids=out.new_token_ids,
                    text=out.new_text,
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    num_output_tokens=len(out.token_ids),
                    logprobs=out.new_logprobs,
                    prefill_replica=prefill_id,
                    top_logprobs=out.new_top_logprobs,
                    stop_reason=out.stop_reason if out.finished else None,
                    queue_seconds=out.queue_seconds if first_chunk else None,
                ).to_bytes()
                first_chunk = False
        finally:
            self.num_active -= 1
            if not finished:  # cancelled, timed out or failed: free everything it held
                # Queued now and shielded: a second cancellation must not cancel the abort
                # before it runs (it also frees blocks still reserved for a transfer).
                await asyncio.shield(asyncio.wrap_future(self.loop.abort(seq.request_id)))

    async def _remote_prefill(self, seq: Sequence, req: DecodeRequest, prefill, prefill_id: str) -> PrefillResult:
        missing, dst_blocks = await self._reserve(seq)
        try:
            try:
                await self._ensure_pair(prefill, prefill_id)
            except Exception as exc:  # retryable on another prefill replica, like a failed prefill
                self._drop_pair(prefill_id)
                raise PrefillFailedError(f"cannot connect to {prefill_id}: {exc!r}") from exc
            transfer_id = next(self._transfer_ids)
            handoff = Handoff(
                request_id=seq.request_id,
                prompt_token_ids=seq.prompt_token_ids,
                sampling=seq.params.to_dict(),
                block_size=seq.block_size,
                source=prefill_id,
                destination=self.replica_id,
                send_block_indices=missing,
                transfer_id=transfer_id,
                epoch=self._epochs.get(prefill_id, 0),
                layerwise=req.layerwise,
                lease_s=req.lease_s,
                deadline=req.deadline,
            )
            # Post every receive before asking for the data: transfers never wait on each other.
            posted = PostedReceive(
                self.transport, self.engine.kv_cache, prefill_id, transfer_id, dst_blocks, req.layerwise
            )
            try:
                result_bytes = await prefill.prefill.remote(handoff.to_bytes())
                num_bytes, _ = await asyncio.to_thread(posted.complete, self.transfer_timeout_s)
            except BaseException as exc:
                # An aborted transfer was completed with filler: the pair is still in step, and
                # other requests' transfers on it go on. Otherwise closing the pair fails the
                # posted receives; wait for them to settle before their blocks are freed.
                if not (isinstance(exc, TransferAbortedError) and await self._receive_filler(posted)):
                    self._drop_pair(prefill_id)
                    await asyncio.to_thread(posted.abandon, 5.0)
                self._ack(prefill, seq.request_id)
                dead = isinstance(exc, (EngineLoopStopped, ray.exceptions.RayActorError))
                error = PrefillReplicaDeadError if dead else PrefillFailedError
                raise error(f"prefill on {prefill_id} failed: {exc}") from exc
        except BaseException:
            await asyncio.wrap_future(self.loop.call(lambda e: e.release_reservation(seq.request_id)))
            raise
        self._ack(prefill, seq.request_id)
        self.num_blocks_received += len(dst_blocks)
        self.num_bytes_received += num_bytes
        result = PrefillResult.from_bytes(result_bytes)
        # The sender's busy time; the receive side's clock would also count the prefill.
        self.transfer_seconds += result.transfer_seconds
        return result

    async def _receive_filler(self, posted: PostedReceive) -> bool:
        """Wait for an aborted transfer's filler (already sent); False if it does not come."""
        try:
            await asyncio.to_thread(posted.complete, self.transfer_timeout_s)
        except Exception:
            return False
        return True

    @staticmethod
    def _ack(prefill, request_id: str | None = None) -> None:
        if request_id is None:
            return
        try:
            prefill.ack.remote(request_id)
        except Exception:  # the prefill replica may be gone; its lease frees the blocks
            pass

    async def _reserve(self, seq: Sequence) -> BlockReservation:
        deadline = time.monotonic() + self.reserve_timeout_s
        while True:
            reservation = await asyncio.wrap_future(self.loop.call(lambda e: e.reserve_prompt_blocks(seq)))
            if reservation is not None:
                return reservation
            if time.monotonic() >= deadline:
                raise ReplicaBusyError(
                    f"{self.replica_id}: no free KV blocks for {seq.num_prompt_tokens} "
                    f"prompt tokens after {self.reserve_timeout_s:.0f} s"
                )
            await asyncio.sleep(0.02)

    async def _ensure_pair(self, prefill, prefill_id: str) -> None:
        lock = self._pair_locks.setdefault(prefill_id, asyncio.Lock())
        async with lock:
            if prefill_id in self._open_pairs:
                return
            epoch = self._epochs.get(prefill_id, 0)
            address = await asyncio.wait_for(prefill.transport_address.remote(), self.transfer_timeout_s)
            await asyncio.wait_for(
                asyncio.gather(
                    prefill.connect.remote(self.replica_id, epoch),
                    asyncio.to_thread(self.transport.open_pair, prefill_id, tuple(address), "receiver", epoch),
                ),
                self.transfer_timeout_s + 5,
            )
            self._open_pairs.add(prefill_id)

    def _drop_pair(self, prefill_id: str) -> None:
        self._open_pairs.discard(prefill_id)
        self._epochs[prefill_id] = self._epochs.get(prefill_id, 0) + 1
        try:
            self.transport.close_pair(prefill_id)
        except Exception:
            logger.exception("closing the pair with %s failed", prefill_id)

    # ---- control and state ---------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self.loop.abort(request_id))

    def transfer_totals(self) -> TransferTotals:
        return TransferTotals(self.num_blocks_received, self.num_bytes_received, self.transfer_seconds)

    async def close_idle_pairs(self, max_idle_s: float) -> list[str]:
        """Tear down process groups unused for max_idle_s; returns the prefill ids affected
        (the caller tells those replicas to drop their side)."""
        closed = await asyncio.to_thread(self.transport.close_idle, max_idle_s)
        for prefill_id in closed:
            self._open_pairs.discard(prefill_id)
            self._epochs[prefill_id] = self._epochs.get(prefill_id, 0) + 1
        return closed

    async def forget_peer(self, prefill_id: str) -> None:
        """A prefill replica left: drop its process group (the next pair with it is a new epoch)."""
        self._drop_pair(prefill_id)
