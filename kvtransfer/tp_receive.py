"""TensorParallelReceive: a real decode replica's posted receives of one transfer
(KVReceiveProtocol), over all its ranks. Rank 0 posts its own (a PostedReceive along its routes
from the prefill replica); each follower rank posts its own from its RankKVPlane when the
command reaches it, lands them in its cache and answers. complete() returns once every rank's
blocks landed -- its bytes the sum over the ranks -- so decode admits the request only when
each rank holds its heads of every block. With TP 1 there are no followers and it is a
PostedReceive."""

from __future__ import annotations

import time
from concurrent.futures import Future

from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.follower_link import wait_answers
from splitserve.kvtransfer.kv_receiver import PostedReceive
from splitserve.kvtransfer.protocols import ReceiveOrder
from splitserve.kvtransfer.rank_commands import RankReceive
from splitserve.kvtransfer.tp_transport import TensorParallelTransport


class TensorParallelReceive:
    def __init__(self, transport: TensorParallelTransport, kv_cache: KVCache, order: ReceiveOrder):
        routes = transport.rank_routes(order.peer_id)
        self.local = PostedReceive(
            transport.local, kv_cache, order.peer_id, order.transfer_id, list(order.block_ids), order.layerwise, routes
        )
        self.num_bytes = 0
        self._start = time.perf_counter()
        self._ranks: list[Future] = []
        if transport.followers is not None and order.block_ids:
            self._ranks = transport.followers.request(lambda number: RankReceive(number, order))

    def complete(self, timeout_s: float) -> tuple[int, float]:
        deadline = time.monotonic() + timeout_s
        for future in self._ranks:  # a rank already lost (or failed to post): nothing will land there
            failure = future.exception() if future.done() else None
            if failure is not None:
                raise failure
        num_bytes, _ = self.local.complete(timeout_s)
        answers = wait_answers(self._ranks, max(deadline - time.monotonic(), 0.001), "KV receive")
        self.num_bytes = num_bytes + sum(rank_bytes for rank_bytes, _ in answers)
        return self.num_bytes, time.perf_counter() - self._start

    def abandon(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.local.abandon(timeout_s)
        for future in self._ranks:
            try:
                future.exception(max(deadline - time.monotonic(), 0.001))
            except Exception:
                pass  # still posted on its rank: that rank's pair closes with the replica's
