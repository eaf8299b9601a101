"""TensorParallelKVSender: a real prefill replica's sender (KVSenderProtocol), over all its
ranks. Rank 0 sends its own KV heads along its routes (a KVSender on the replica's
TensorParallelTransport); each follower rank sends its own share of the same job from its
RankKVPlane: a layer-wise job rides on the very forward that computes it (the step's per-layer
callback carries it to the followers, engine/parallel/follower_extension.py), a packed job goes
as a command once its step is done.

The worker sees one job: its `done` resolves once every rank's share is out -- its bytes the
sum over the ranks, its seconds the slowest rank's -- and fails if any rank's failed; an
aborted job's `flushed` is True once every rank's pairs are in step. With TP 1 there are no
followers and it is a KVSender.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.kv_sender import KVSender
from splitserve.kvtransfer.rank_commands import AbortSend, RankSend, SendLayers, SendWhole
from splitserve.kvtransfer.send_job import SendJob
from splitserve.kvtransfer.tp_transport import TensorParallelTransport


class _LayerCallback:
    """A step's per-layer callback that also carries the followers' share of it (rank_work)."""

    def __init__(self, callback: Callable[[int], None], rank_work: SendLayers):
        self.callback = callback
        self.rank_work = rank_work

    def __call__(self, layer: int) -> None:
        self.callback(layer)


@dataclass
class _Shares:
    """One job's follower shares: their answers, and whether rank 0's own is done."""

    spec: RankSend
    sent: list[Future]
    flushed: list[Future] = field(default_factory=list)
    local_sent: bool = False
    local_flushed: bool | None = None


class TensorParallelKVSender(KVSender):
    def __init__(self, transport: TensorParallelTransport, kv_cache: KVCache):
        super().__init__(transport.local, kv_cache, transport.rank_routes)
        self.followers = transport.followers
        self._shares: dict[int, _Shares] = {}  # id(job) -> its follower shares
        self._shares_lock = threading.Lock()
        self._totals_lock = threading.Lock()  # jobs complete on the sender thread and on the followers' listener

    def layer_callback(self, jobs: Sequence[SendJob]) -> Callable[[int], None]:
        callback = super().layer_callback(jobs)
        if self.followers is None:
            return callback
        return _LayerCallback(callback, SendLayers(tuple(self._share(job).spec for job in jobs)))

    def send_all(self, job: SendJob) -> None:
        if self.followers is not None:
            self.followers.command(SendWhole(self._share(job).spec))
        super().send_all(job)

    def abort(self, job: SendJob) -> Future:
        if self.followers is not None:
            shares = self._share(job, expect_sent=False)
            shares.flushed = self.followers.request(lambda number: AbortSend(number, shares.spec))
            for future in shares.flushed:
                future.add_done_callback(lambda _: self._settle_flush(job))
        return super().abort(job)

    def _share(self, job: SendJob, expect_sent: bool = True) -> _Shares:
        """The job's follower shares, registered on first use (its spec numbered for the
        followers' answers)."""
        assert self.followers is not None
        with self._shares_lock:
            shares = self._shares.get(id(job))
            if shares is None:
                number = self.followers.next_number()
                spec = RankSend(
                    number,
                    job.request_id,
                    job.peer_id,
                    job.transfer_id,
                    tuple(job.block_ids),
                    job.layerwise,
                    job.num_blocks or len(job.block_ids),
                )
                shares = self._shares[id(job)] = _Shares(spec, self.followers.expect(number) if expect_sent else [])
                job.done.add_done_callback(lambda _: self._forget(job))
                for future in shares.sent:
                    future.add_done_callback(lambda _: self._settle_send(job))
        return shares

    def _forget(self, job: SendJob) -> None:
        with self._shares_lock:
            self._shares.pop(id(job), None)

    # ---- rank 0's share done: wait for the followers' -------------------------------------
    def _complete(self, job: SendJob) -> None:
        with self._shares_lock:
            shares = self._shares.get(id(job))
            if shares is not None:
                shares.local_sent = True
        if shares is None:
            with self._totals_lock:
                super()._complete(job)
        else:
            self._settle_send(job)

    def _settle_send(self, job: SendJob) -> None:
        with self._shares_lock:
            shares = self._shares.get(id(job))
            if shares is None or not shares.local_sent or not all(f.done() for f in shares.sent):
                return
            shares.local_sent = False  # settled once
        errors = [f.exception() for f in shares.sent if f.exception() is not None]
        if errors:
            job.failed = True
            if job.done.set_running_or_notify_cancel():
                job.done.set_exception(errors[0] or TransferError(f"a follower's send of {job.request_id} failed"))
            return
        answers = [f.result() for f in shares.sent]
        job.num_bytes += sum(num_bytes for num_bytes, _ in answers)
        job.seconds = max([job.seconds, *(seconds for _, seconds in answers)])
        with self._totals_lock:
            super()._complete(job)

    def _flushed(self, job: SendJob, flushed: bool) -> None:
        with self._shares_lock:
            shares = self._shares.get(id(job))
            if shares is not None and shares.flushed:
                shares.local_flushed = flushed
        if shares is None or not shares.flushed:
            super()._flushed(job, flushed)
        else:
            self._settle_flush(job)

    def _settle_flush(self, job: SendJob) -> None:
        with self._shares_lock:
            shares = self._shares.get(id(job))
            if shares is None or shares.local_flushed is None or not all(f.done() for f in shares.flushed):
                return
            local, shares.local_flushed = shares.local_flushed, None
            self._shares.pop(id(job), None)
        in_step = local and all(f.exception() is None and f.result() for f in shares.flushed)
        super()._flushed(job, in_step)
