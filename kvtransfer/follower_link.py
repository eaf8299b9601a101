"""FollowerLink: a tensor-parallel replica's driver side of its follower ranks' KV planes --
commands out over the engine's rank pipes (engine/parallel/tp_ranks.py's command), each
answer matched to a future by its number. A rank that goes away fails every future still
waiting on it at once, and every later request (the replica is lost with it)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from splitserve.engine.parallel.tp_group import TensorParallelError
from splitserve.engine.parallel.tp_ranks import TensorParallelRanks
from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.rank_commands import Reply


class FollowerLink:
    def __init__(self, ranks: TensorParallelRanks):
        self.ranks = ranks
        self.followers = range(1, ranks.size)
        self._numbers = itertools.count(1)
        self._waiting: dict[tuple[int, int], Future] = {}  # (number, rank) -> its answer
        self._gone: dict[int, str] = {}  # rank -> why
        self._lock = threading.Lock()
        ranks.listen(self._on_reply)

    def request(self, make: Callable[[int], Any]) -> list[Future]:
        """Send make(number) to every follower; returns one future per follower, in rank
        order, for its answer (TransferError if it failed or its rank went away)."""
        number = next(self._numbers)
        futures = self.expect(number)
        self.command(make(number))
        return futures

    def expect(self, number: int) -> list[Future]:
        """Futures for each follower's answer to a command numbered `number` (sent elsewhere:
        a forward's work)."""
        futures = []
        with self._lock:
            for rank in self.followers:
                future: Future = Future()
                if rank in self._gone:
                    future.set_exception(TransferError(self._gone[rank]))
                else:
                    self._waiting[number, rank] = future
                futures.append(future)
        return futures

    def next_number(self) -> int:
        return next(self._numbers)

    def command(self, payload: Any) -> None:
        try:
            self.ranks.command(payload)
        except TensorParallelError as exc:
            raise TransferError(str(exc)) from exc

    def _on_reply(self, rank: int, reply: Reply | None) -> None:
        if reply is None:  # its connection ended: nothing it owes will come
            why = f"tensor-parallel rank {rank} is gone"
            with self._lock:
                self._gone[rank] = why
                lost = [key for key in self._waiting if key[1] == rank]
                futures = [self._waiting.pop(key) for key in lost]
            for future in futures:
                future.set_exception(TransferError(why))
            return
        with self._lock:
            waiting = self._waiting.pop((reply.number, rank), None)
        if waiting is None:
            return
        future = waiting
        if reply.error is not None:
            future.set_exception(TransferError(f"tensor-parallel rank {rank}: {reply.error}"))
        else:
            future.set_result(reply.value)


def wait_answers(futures: list[Future], timeout_s: float, what: str) -> list[Any]:
    """Every future's answer, within timeout_s in all; TransferError naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    answers = []
    for future in futures:
        try:
            answers.append(future.result(max(deadline - time.monotonic(), 0.0)))
        except FutureTimeout:
            raise TransferError(f"{what}: a follower rank did not answer within {timeout_s:.1f}s") from None
    return answers
