"""PrefillClient: a decode replica's side of remote prefill. It asks a prefill replica (a
named actor, looked up once) to compute a prompt and send the KV blocks this replica lacks over
their pair, receives them into the reserved blocks, and gives a transfer up
cleanly: on a timeout derived from the prefill pool's measured speed (PrefillTimeout), a
failure or a cancel, the prefill replica is told to stop, and the reserved blocks may be freed
only once no transfer can still write into them. It keeps the pairs (one per prefill replica,
numbered by epoch) and the transfer totals the replica reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

import ray

from splitserve.decode.prefill_timeout import PrefillTimeout
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.engine_errors import EngineLoopStopped
from splitserve.engine.io.block_reservation import BlockReservation
from splitserve.kvtransfer.protocols import KVReceiveProtocol, KVTransportProtocol, ReceiveOrder
from splitserve.proto.messages.handoff import Handoff, PrefillResult
from splitserve.proto.messages.poll_reply import TransferTotals
from splitserve.proto.messages.request_channel import FailureKind, Submit

logger = logging.getLogger(__name__)
ABANDON_GRACE_S = 0.5  # how long a given-up transfer may take to settle before its pair is closed
Reserve = Callable[[Sequence], Awaitable[BlockReservation]]
# A transfer's receives posted into this replica's KV cache (KVDataPlane.post_receive, bound to it).
PostReceive = Callable[[ReceiveOrder], KVReceiveProtocol]


class PrefillFailedError(RuntimeError):
    """The remote prefill or the KV transfer failed; no token reached the client, so the
    ingress may retry on another prefill replica."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.PREFILL_FAILED):
        super().__init__(message)
        self.kind = kind


class ReplicaBusyError(RuntimeError):
    """No KV blocks came free for the prompt in time."""


class PrefillClient:
    def __init__(
        self,
        replica_id: str,
        transport: KVTransportProtocol,
        post_receive: PostReceive,
        namespace: str | None,
        transfer_timeout_s: float,
    ):
        self.replica_id = replica_id
        self.transport = transport
        self.post_receive = post_receive
        self.namespace = namespace
        self.transfer_timeout_s = transfer_timeout_s
        self.prefill_timeout = PrefillTimeout(ceiling_s=transfer_timeout_s)
        self._epochs: dict[str, int] = {}
        self._open_pairs: set[str] = set()
        self._pair_locks: dict[str, asyncio.Lock] = {}
        self._transfer_ids = itertools.count(1)
        self._prefill_handles: dict[str, object] = {}
        self.num_blocks_received = 0
        self.num_bytes_received = 0
        self.transfer_seconds = 0.0

    async def fetch(self, seq: Sequence, submit: Submit, reserve: Reserve) -> PrefillResult:
        """Reserve blocks (reserve(seq)), have the prefill replica compute the prompt and send
        what this replica lacks into its KV cache, receive it. The caller frees the reservation if
        this does not return."""
        prefill_id = submit.prefill_replica_id
        prefill = await self._prefill_handle(prefill_id)
        missing, dst_blocks = await reserve(seq)
        try:
            await self._ensure_pair(prefill, prefill_id)
        except Exception as exc:  # retryable on another prefill replica, like a failed prefill
            self._drop_pair(prefill_id)
            raise PrefillFailedError(f"cannot connect to {prefill_id}: {short_error(exc)}") from exc
        transfer_id = next(self._transfer_ids)
        handoff = Handoff(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            sampling=seq.params,
            block_size=seq.block_size,
            source=prefill_id,
            destination=self.replica_id,
            send_block_indices=missing,
            transfer_id=transfer_id,
            epoch=self._epochs.get(prefill_id, 0),
            layerwise=submit.layerwise,
            lease_s=submit.lease_s,
            deadline=submit.deadline,
            early_first_token=submit.early_first_token,
        )
        # Post every receive before asking for the data: transfers never wait on each other.
        posted = self.post_receive(ReceiveOrder(prefill_id, transfer_id, tuple(dst_blocks), submit.layerwise))
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
            raise PrefillFailedError(f"prefill on {prefill_id} failed: {short_error(exc)}", kind) from exc
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

    async def _ensure_pair(self, prefill, prefill_id: str) -> None:
        lock = self._pair_locks.setdefault(prefill_id, asyncio.Lock())
        async with lock:
            if prefill_id in self._open_pairs:
                return
            epoch = self._epochs.get(prefill_id, 0)
            address = await asyncio.wait_for(prefill.transport_address.remote(), self.transfer_timeout_s)
            await asyncio.wait_for(
                asyncio.gather(
                    prefill.open_pair.remote(self.replica_id, epoch, self.transport.address),
                    asyncio.to_thread(self.transport.open_pair, prefill_id, address, "receiver", epoch),
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

    def transfer_totals(self) -> TransferTotals:
        return TransferTotals(self.num_blocks_received, self.num_bytes_received, self.transfer_seconds)

    async def close_idle_pairs(self, max_idle_s: float) -> list[tuple[str, int]]:
        """Close the pairs unused for max_idle_s; returns each prefill id affected with the
        epoch closed (its side must close that epoch only: a request may open the next one first)."""
        closed = await asyncio.to_thread(self.transport.close_idle, max_idle_s)
        epochs = []
        for prefill_id in closed:
            self._open_pairs.discard(prefill_id)
            epoch = self._epochs.get(prefill_id, 0)
            self._epochs[prefill_id] = epoch + 1
            epochs.append((prefill_id, epoch))
        return epochs

    def forget_peer(self, prefill_id: str, epoch: int | None = None) -> None:
        """A prefill replica left: drop the pair with it (the next pair with it is a new
        epoch). epoch: only if the pair is not newer."""
        if epoch is not None and self._epochs.get(prefill_id, 0) > epoch:
            return
        self._drop_pair(prefill_id)
        self._prefill_handles.pop(prefill_id, None)


def _fire(method, *args) -> None:
    """A fire-and-forget actor call; the peer may be gone (its lease frees what it holds)."""
    try:
        method.remote(*args)
    except Exception:
        pass


def short_error(exc: BaseException) -> str:
    """One line for a client: the original error's message (a Ray error's own text is a
    traceback with paths and pids), its last line if it has several."""
    cause = getattr(exc, "cause", None)  # a RayTaskError's original exception
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip().splitlines()
    return text[-1].strip() if text else type(exc).__name__
