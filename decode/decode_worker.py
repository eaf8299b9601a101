"""DecodeWorker (a Ray actor): takes requests from the ingresses over its request channel
(decode/channel_server.py), reserves blocks for each prompt, pulls the ones it lacks from a
prefill replica over torch.distributed, then runs the request in its continuous batch. With
no prefill replica named it prefills locally (conditional disaggregation, colocated mode).

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
import itertools
import logging
import time
from dataclasses import dataclass

import ray

from splitserve.decode.channel_server import ChannelServer, IngressConnection
from splitserve.decode.prefill_timeout import PrefillTimeout
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.engine_errors import EngineLoopStopped, EngineStepError
from splitserve.engine.io.block_reservation import BlockReservation
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.kvtransfer.engine_worker import EngineWorker
from splitserve.kvtransfer.handoff import Handoff, PrefillResult, StreamChunk
from splitserve.kvtransfer.kv_receiver import PostedReceive
from splitserve.kvtransfer.poll_reply import TransferTotals
from splitserve.kvtransfer.request_channel import Failed, FailureKind, Submit, TokenBatch, encode_frame

logger = logging.getLogger(__name__)
ABANDON_GRACE_S = 0.5  # how long a given-up transfer may take to settle before its pair is closed


class PrefillFailedError(RuntimeError):
    """The remote prefill or the KV transfer failed; no token reached the client, so the
    ingress may retry on another prefill replica."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.PREFILL_FAILED):
        super().__init__(message)
        self.kind = kind


class ReplicaBusyError(RuntimeError):
    """No KV blocks came free for the prompt in time."""


@dataclass(eq=False)
class _Request:
    submit: Submit
    conn: IngressConnection
    task: asyncio.Task | None = None
    aborted: bool = False
    num_tokens_sent: int = 0
    num_chunks_sent: int = 0


class DecodeWorker(EngineWorker):
    def __init__(
        self,
        replica_id: str,
        engine_config: dict,
        transport_host: str = "127.0.0.1",
        transfer_timeout_s: float = 20.0,
        torch_threads: int | None = None,
        reserve_timeout_s: float = 30.0,
        namespace: str | None = None,
    ):
        super().__init__(
            replica_id, engine_config, transport_host, transfer_timeout_s, torch_threads, namespace=namespace
        )
        self.reserve_timeout_s = reserve_timeout_s
        self.prefill_timeout = PrefillTimeout(ceiling_s=transfer_timeout_s)
        self._epochs: dict[str, int] = {}
        self._open_pairs: set[str] = set()
        self._pair_locks: dict[str, asyncio.Lock] = {}
        self._transfer_ids = itertools.count(1)
        self._prefill_handles: dict[str, object] = {}
        self._requests: dict[str, _Request] = {}
        self._outputs: list[tuple[str, RequestOutput | Exception]] = []  # loop thread: since the last flush
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._channel: ChannelServer | None = None
        self._channel_lock = asyncio.Lock()
        self.admission_delay_s = 0.0  # chaos testing: see delay_admission
        self.num_blocks_received = 0
        self.num_bytes_received = 0
        self.transfer_seconds = 0.0
        self.start_loop(flush_outputs=self._flush_outputs)

    # ---- the request channel -------------------------------------------------------------
    async def ready(self) -> str:
        await self.channel_address()
        return self.replica_id

    async def channel_address(self) -> tuple[str, int]:
        """Where ingresses connect (ReplicaInfo.channel_address); the server starts on first call."""
        async with self._channel_lock:
            if self._channel is None:
                self._event_loop = asyncio.get_running_loop()
                channel = ChannelServer(self.replica_id, self._on_submit, self._on_abort, self._on_close)
                await channel.start(self.host)
                self._channel = channel
        return self._channel.address

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
        if not req.aborted:
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
            return FailureKind.STEP_FAILED, False, _short(exc)
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
            params = SamplingParams.from_dict(submit.sampling)
            # A constrained request's grammar is compiled off the engine loop, within the deadline.
            seq = await self.loop.make_sequence(submit.prompt_token_ids, params, rid, deadline=submit.deadline)
            sink = self._sink(rid)
            if submit.prefill_replica_id is None:
                await asyncio.wrap_future(self.loop.add_sequence(seq, sink))
            else:
                first = await self._remote_prefill(seq, submit)
                if self.admission_delay_s:
                    await asyncio.sleep(self.admission_delay_s)
                await asyncio.wrap_future(
                    self.loop.admit_prefilled(
                        rid,
                        first.first_token,
                        first.first_logprob,
                        first.num_cached_tokens,
                        sink,
                        first.first_top_logprobs,
                        first.queue_seconds,
                    )
                )
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

    def _sink(self, request_id: str):
        def sink(item: RequestOutput | Exception) -> None:  # loop thread: only collect; see _flush_outputs
            self._outputs.append((request_id, item))

        return sink

    def _flush_outputs(self) -> None:
        """Engine loop thread, once per step that produced outputs: one hand-over for all."""
        items, self._outputs = self._outputs, []
        if items and self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._send_outputs, items)

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
                )
            )
            req.num_chunks_sent += 1
            req.num_tokens_sent += len(item.new_token_ids)
            if item.finished:
                self._forget(req)
        for conn, (chunks, failures) in frames.items():
            data = encode_frame(TokenBatch(chunks)) if chunks else b""
            conn.send(data + b"".join(failures))

    # ---- remote prefill ------------------------------------------------------------------
    async def _remote_prefill(self, seq: Sequence, submit: Submit) -> PrefillResult:
        """Reserve blocks, have the prefill replica compute the prompt and send what this
        replica lacks, receive it. The caller frees the reservation if this does not return."""
        prefill_id = submit.prefill_replica_id
        prefill = await self._prefill_handle(prefill_id)
        missing, dst_blocks = await self._reserve(seq)
        try:
            await self._ensure_pair(prefill, prefill_id)
        except Exception as exc:  # retryable on another prefill replica, like a failed prefill
            self._drop_pair(prefill_id)
            raise PrefillFailedError(f"cannot connect to {prefill_id}: {_short(exc)}") from exc
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
            layerwise=submit.layerwise,
            lease_s=submit.lease_s,
            deadline=submit.deadline,
        )
        # Post every receive before asking for the data: transfers never wait on each other.
        posted = PostedReceive(
            self.transport, self.engine.kv_cache, prefill_id, transfer_id, dst_blocks, submit.layerwise
        )
        limit_s = self.prefill_timeout.limit_s(seq.num_prompt_tokens)
        if submit.deadline is not None:
            limit_s = max(min(limit_s, submit.deadline - time.time()), 0.001)
        started = time.monotonic()
        prefilled = asyncio.wrap_future(prefill.prefill.remote(handoff.to_bytes()).future())
        received = None
        try:
            try:
                result_bytes = await asyncio.wait_for(asyncio.shield(prefilled), limit_s)
            except TimeoutError:
                raise PrefillFailedError(
                    f"prefill on {prefill_id} did not answer within {limit_s:.1f} s", FailureKind.PREFILL_TIMEOUT
                ) from None
            received = asyncio.get_running_loop().run_in_executor(None, posted.complete, self.transfer_timeout_s)
            num_bytes, _ = await asyncio.shield(received)
        except BaseException as exc:
            hung = isinstance(exc, PrefillFailedError)  # timed out: nothing will come, close the pair now
            await asyncio.shield(self._abandon(prefill, prefill_id, seq.request_id, posted, prefilled, received, hung))
            if isinstance(exc, (asyncio.CancelledError, PrefillFailedError)):
                raise
            dead = isinstance(exc, (ray.exceptions.RayActorError, EngineLoopStopped))
            kind = FailureKind.PREFILL_DEAD if dead else FailureKind.PREFILL_FAILED
            raise PrefillFailedError(f"prefill on {prefill_id} failed: {_short(exc)}", kind) from exc
        self._ack(prefill, seq.request_id)
        result = PrefillResult.from_bytes(result_bytes)
        self.prefill_timeout.observe(seq.num_prompt_tokens, time.monotonic() - started)
        self.num_blocks_received += len(dst_blocks)
        self.num_bytes_received += num_bytes
        # The sender's busy time; the receive side's clock would also count the prefill.
        self.transfer_seconds += result.transfer_seconds
        return result

    async def _abandon(self, prefill, prefill_id: str, rid: str, posted, prefilled, received, hung: bool) -> None:
        """Give a transfer up so its blocks can be freed. The prefill replica is told to stop
        (cancel). If the posted receives still complete within ABANDON_GRACE_S (the data, or
        a sender's filler, was on its way), the pair stays in step for the other transfers on
        it; otherwise it is closed, which fails the receives, and they settle first."""
        if not prefilled.done():
            _fire(prefill.cancel, rid)
        loop = asyncio.get_running_loop()
        if received is None and not hung:
            received = loop.run_in_executor(None, posted.complete, ABANDON_GRACE_S)
        in_step = False
        if received is not None:
            try:
                await asyncio.wait_for(asyncio.shield(received), ABANDON_GRACE_S)
                in_step = True
            except BaseException:
                pass
        if not in_step:
            epoch = self._epochs.get(prefill_id, 0)
            self._drop_pair(prefill_id)
            # Its sender must not wait on the dead pair until the transfer timeout.
            _fire(prefill.forget_peer, self.replica_id, epoch)
            if received is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(received), 5.0)
            await asyncio.to_thread(posted.abandon, 5.0)
        _fire(prefill.ack, rid)

    async def _prefill_handle(self, prefill_id: str):
        handle = self._prefill_handles.get(prefill_id)
        if handle is None:
            try:
                handle = await asyncio.to_thread(ray.get_actor, prefill_id, namespace=self.namespace)
            except ValueError:
                raise PrefillFailedError(f"prefill replica {prefill_id} is gone", FailureKind.PREFILL_DEAD) from None
            self._prefill_handles[prefill_id] = handle
        return handle

    @staticmethod
    def _ack(prefill, request_id: str) -> None:
        _fire(prefill.ack, request_id)

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
    async def delay_admission(self, seconds: float) -> None:
        """Chaos testing: wait this long between a remote prefill's transfer and the request's
        admission -- the window in which a cancel must still free the reservation."""
        self.admission_delay_s = max(float(seconds), 0.0)

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

    async def forget_peer(self, prefill_id: str, epoch: int | None = None) -> None:
        """A prefill replica left: drop its process group (the next pair with it is a new
        epoch). epoch: only if the pair is not newer."""
        if epoch is not None and self._epochs.get(prefill_id, 0) > epoch:
            return
        self._drop_pair(prefill_id)
        self._prefill_handles.pop(prefill_id, None)

    async def shutdown(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        await super().shutdown()


def _fire(method, *args) -> None:
    """A fire-and-forget actor call; the peer may be gone (its lease frees what it holds)."""
    try:
        method.remote(*args)
    except Exception:
        pass


def _short(exc: BaseException) -> str:
    """One line for a client: the original error's message (a Ray error's own text is a
    traceback with paths and pids), its last line if it has several."""
    cause = getattr(exc, "cause", None)  # a RayTaskError's original exception
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip().splitlines()
    return text[-1].strip() if text else type(exc).__name__
