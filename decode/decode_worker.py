"""DecodeWorker (a Ray actor): takes requests from the ingresses over its request channel
(runtime/replica_channel_server.py), reserves blocks for each prompt, pulls the ones it lacks from a
prefill replica over torch.distributed, then runs the request in its continuous batch. With
no prefill replica named it prefills locally (conditional disaggregation, colocated mode).
With Submit.early_first_token the prefill replica pushes the first token (first_token) before
the KV lands: it streams at once, and the sequence waits, reserved, to join the batch.

Tokens go back in one TokenBatch frame per engine step per ingress connection: the engine
loop's sinks only append to a list, and `flush_outputs` hands the step's list to the actor's
event loop with one call_soon_threadsafe; no Ray message per token.

A request that is aborted (Abort frame, its connection closed) at any point frees everything
it holds: before admission its set-up task is cancelled and its clean-up queues an abort on
the engine loop *after* whatever it had queued there (a reservation that was still being
made is freed too); a remote prefill in flight is told to stop, and the reserved blocks are
freed only once no transfer can still write into them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field

from splitserve.decode.first_token_clock import FirstTokenClock
from splitserve.decode.prefill_client import PrefillClient, PrefillFailedError, ReplicaBusyError, short_error
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.engine_errors import EngineLoopStopped, EngineStepError
from splitserve.engine.io.block_reservation import BlockReservation
from splitserve.engine.io.request_output import RequestOutput
from splitserve.proto.messages.handoff import PrefillResult, StreamChunk
from splitserve.proto.messages.poll_reply import TransferTotals
from splitserve.proto.messages.request_channel import Failed, FailureKind, Submit, TokenBatch, encode_frame
from splitserve.runtime.engine_worker import EngineWorker
from splitserve.runtime.replica_channel_server import IngressConnection
from splitserve.runtime.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    submit: Submit
    conn: IngressConnection
    task: asyncio.Task | None = None
    aborted: bool = False
    num_tokens_sent: int = 0
    num_chunks_sent: int = 0
    clock: FirstTokenClock = field(default_factory=FirstTokenClock)  # its first token's stages


class DecodeWorker(EngineWorker):
    def __init__(self, replica_id: str, worker: WorkerConfig):
        super().__init__(replica_id, worker)
        self.reserve_timeout_s = worker.reserve_timeout_s
        self.prefill = PrefillClient(
            replica_id,
            self.transport,
            functools.partial(self.data_plane.post_receive, self.transport, self.engine),
            worker.namespace,
            worker.transfer_timeout_s,
        )
        self._requests: dict[str, _Request] = {}
        self._outputs: list[tuple[str, RequestOutput | Exception]] = []  # loop thread: since the last flush
        self.admission_delay_s = 0.0  # chaos testing: see delay_admission
        self.start_loop(flush_outputs=self._flush_outputs)

    # ---- the request channel -------------------------------------------------------------
    def _request_callbacks(self):
        return self._on_submit, self._on_abort, self._on_close

    def _on_submit(self, conn: IngressConnection, submit: Submit) -> None:
        rid = submit.request_id
        if rid in self._requests:  # ids are the ingress's own and unique: never let one clobber another
            message = f"request id {rid!r} is already in use on {self.replica_id}"
            conn.send(encode_frame(Failed(rid, FailureKind.INTERNAL, False, message)))
            return
        req = self._requests[rid] = _Request(submit, conn)
        conn.request_ids.add(rid)
        self.num_active = len(self._requests)
        req.task = asyncio.get_running_loop().create_task(self._start(req))

    async def migrate_streams(self) -> int:
        """A drain's planned move: every request here ends with REPLICA_DRAINING and is freed at
        once; the ingress continues each stream that sent tokens on another replica (exactly,
        from the tokens its client has: ones produced here but not yet sent are recomputed
        there) and retries the others. Returns how many were handed off."""
        handed = 0
        for req in list(self._requests.values()):
            if req.aborted:
                continue
            message = f"decode replica {self.replica_id} is draining"
            req.conn.send(encode_frame(Failed(req.submit.request_id, FailureKind.REPLICA_DRAINING, True, message)))
            self._abort(req)  # after the frame: nothing of it is sent after the failure
            handed += 1
        return handed

    def _on_abort(self, conn: IngressConnection, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.conn is conn:
            self._abort(req)

    def _on_close(self, conn: IngressConnection) -> None:
        """The ingress went away: nobody reads these requests' tokens any more."""
        for request_id in list(conn.request_ids):
            req = self._requests.get(request_id)
            if req is not None:
                self._abort(req)

    def _abort(self, req: _Request) -> None:
        if req.aborted:
            return
        req.aborted = True
        if req.task is not None and not req.task.done():
            req.task.cancel()  # its clean-up frees whatever it holds
        else:  # admitted: the engine frees its blocks
            self.loop.abort(req.submit.request_id)
            self._forget(req)

    def _forget(self, req: _Request) -> None:
        rid = req.submit.request_id
        if self._requests.get(rid) is req:
            del self._requests[rid]
        req.conn.request_ids.discard(rid)
        self.num_active = len(self._requests)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        # Not once its stream ended otherwise (an early first token's sink got the loop's stop).
        if not req.aborted and self._requests.get(req.submit.request_id) is req:
            kind, retryable, message = self._failure(req, exc)
            req.conn.send(encode_frame(Failed(req.submit.request_id, kind, retryable, message)))

    def _failure(self, req: _Request, exc: BaseException) -> tuple[FailureKind, bool, str]:
        """(kind, retryable, client-safe message) for a request's failure; unexpected ones are
        logged here with their traceback and ids, never sent."""
        if isinstance(exc, PrefillFailedError):
            return exc.kind, True, str(exc)
        if isinstance(exc, ReplicaBusyError):
            return FailureKind.BUSY, True, str(exc)
        if isinstance(exc, EngineLoopStopped):
            return FailureKind.REPLICA_DEAD, req.num_tokens_sent == 0, f"decode replica {self.replica_id} stopped"
        if isinstance(exc, EngineStepError):
            return FailureKind.STEP_FAILED, False, short_error(exc)
        if isinstance(exc, ValueError):  # InvalidRequestError: the request itself is bad; its own words
            return FailureKind.INVALID, False, str(exc).strip()[:2000]
        rid, label = req.submit.request_id, req.submit.label
        logger.error("request %s (client id %r) failed on %s", rid, label, self.replica_id, exc_info=exc)
        return FailureKind.INTERNAL, False, f"internal error on {self.replica_id} (request {rid})"

    # ---- one request ---------------------------------------------------------------------
    async def _start(self, req: _Request) -> None:
        """Set a request up until it joins the running batch; from then on its outputs go
        through the sink, and an abort goes straight to the engine."""
        submit = req.submit
        rid = submit.request_id
        admitted = False
        try:
            params = submit.sampling
            # A constrained request's grammar is compiled off the engine loop, within the deadline.
            seq = await self.loop.make_sequence(submit.prompt_token_ids, params, rid, deadline=submit.deadline)
            sink = self._sink(rid, req.clock)
            req.clock.mark_set_up()
            if submit.prefill_replica_id is None:
                await asyncio.wrap_future(self.loop.add_sequence(seq, sink))
            else:
                first = await self.prefill.fetch(seq, submit, self._reserve)
                req.clock.mark_fetched(first)
                if self.admission_delay_s:
                    await asyncio.sleep(self.admission_delay_s)
                await asyncio.wrap_future(self.loop.admit_prefilled(rid, first, sink))
            admitted = not req.aborted
        except asyncio.CancelledError:
            pass  # aborted: the ingress said so, or its connection closed
        except Exception as exc:
            self._fail(req, exc)
        finally:
            if not admitted:
                # FIFO on the engine loop: this runs after anything the request queued there,
                # so a reservation or a sequence that got in is freed too.
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.wrap_future(self.loop.abort(rid)))
                self._forget(req)

    async def first_token(self, request_id: str, result_bytes: bytes) -> None:
        """A remote prefill's first token, pushed by its prefill replica as soon as it was sampled
        (Submit.early_first_token): it streams now, while the KV still moves; the sequence
        joins the batch when the prefill call's answer says the KV is in (_start). Ignored
        where that answer came first, the request is gone, or the token could end it."""
        req = self._requests.get(request_id)
        if req is None or req.aborted or not req.submit.early_first_token:
            return
        first = PrefillResult.from_bytes(result_bytes)
        clock = req.clock

        def sink(item: RequestOutput | Exception) -> None:  # loop thread
            clock.mark_fetched(first)  # the first output is this one: its stages end here
            clock.mark_first_output()
            self._outputs.append((request_id, item))

        with contextlib.suppress(Exception):  # e.g. the loop stopped: the request fails from _start
            await asyncio.wrap_future(self.loop.accept_first_token(request_id, first, sink))

    def _sink(self, request_id: str, clock: FirstTokenClock):
        def sink(item: RequestOutput | Exception) -> None:  # loop thread: only collect; see _flush_outputs
            clock.mark_first_output()
            self._outputs.append((request_id, item))

        return sink

    def _flush_outputs(self) -> None:
        """Engine loop thread, once per step that produced outputs: one hand-over for all."""
        items, self._outputs = self._outputs, []
        if items and self.event_loop is not None:
            self.event_loop.call_soon_threadsafe(self._send_outputs, items)

    def _send_outputs(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        """Actor event loop: group a step's outputs by connection; one write per connection."""
        frames: dict[IngressConnection, tuple[list[StreamChunk], list[bytes]]] = {}
        for rid, item in items:
            req = self._requests.get(rid)
            if req is None or req.aborted:
                continue
            chunks, failures = frames.setdefault(req.conn, ([], []))
            if isinstance(item, Exception):  # its step failed or the loop stopped; blocks already freed
                kind, retryable, message = self._failure(req, item)
                failures.append(encode_frame(Failed(rid, kind, retryable, message)))
                self._forget(req)
                continue
            stages, replica_seconds = req.clock.stages(item.queue_seconds) if not req.num_chunks_sent else ({}, None)
            chunks.append(
                StreamChunk(
                    request_id=rid,
                    token_ids=item.new_token_ids,
                    text=item.new_text,
                    finished=item.finished,
                    finish_reason=item.finish_reason,
                    num_prompt_tokens=item.num_prompt_tokens,
                    num_cached_tokens=item.num_cached_tokens,
                    num_output_tokens=len(item.token_ids),
                    logprobs=item.new_logprobs,
                    prefill_replica=req.submit.prefill_replica_id,
                    top_logprobs=item.new_top_logprobs,
                    stop_reason=item.stop_reason if item.finished else None,
                    queue_seconds=item.queue_seconds if not req.num_chunks_sent else None,
                    prompt_logprobs=item.prompt_logprobs if not req.num_chunks_sent else [],
                    prompt_top_logprobs=item.prompt_top_logprobs if not req.num_chunks_sent else [],
                    prompt_ranks=item.prompt_ranks if not req.num_chunks_sent else [],
                    first_token_stages=stages,
                    replica_seconds=replica_seconds,
                )
            )
            req.num_chunks_sent += 1
            req.num_tokens_sent += len(item.new_token_ids)
            if item.finished:
                self._forget(req)
        for conn, (chunks, failures) in frames.items():
            data = encode_frame(TokenBatch(chunks)) if chunks else b""
            conn.send(data + b"".join(failures))

    # ---- blocks for a remote prefill ------------------------------------------------------
    async def _reserve(self, seq: Sequence) -> BlockReservation:
        deadline = time.monotonic() + self.reserve_timeout_s
        while True:
            reservation = await asyncio.wrap_future(self.loop.reserve_prompt_blocks(seq))
            if reservation is not None:
                return reservation
            if time.monotonic() >= deadline:
                raise ReplicaBusyError(
                    f"{self.replica_id}: no free KV blocks for {seq.num_prompt_tokens} "
                    f"prompt tokens after {self.reserve_timeout_s:.0f} s"
                )
            await asyncio.sleep(0.02)

    # ---- control and state ---------------------------------------------------------------
    async def delay_admission(self, seconds: float) -> None:
        """Chaos testing: wait this long between a remote prefill's transfer and the request's
        admission -- the window in which a cancel must still free the reservation."""
        self.admission_delay_s = max(float(seconds), 0.0)

    def transfer_totals(self) -> TransferTotals:
        return self.prefill.transfer_totals()

    async def close_idle_pairs(self, max_idle_s: float) -> list[tuple[str, int]]:
        """Close the pairs unused for max_idle_s; returns the prefill ids affected, each with
        the epoch closed (the caller tells those replicas to drop their side of that epoch)."""
        return await self.prefill.close_idle_pairs(max_idle_s)

    async def forget_peer(self, prefill_id: str, epoch: int | None = None) -> None:
        """A prefill replica left, or closed its side of the pair (epoch: the one it closed;
        a newer pair is kept): drop ours too."""
        self.prefill.forget_peer(prefill_id, epoch)
