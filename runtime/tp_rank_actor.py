"""TensorParallelRankActor: one follower rank (1..N-1) of a tensor-parallel replica's gang, and
launch_rank_actors, how the replica's rank 0 starts them (engine/parallel/tp_ranks.py's
FollowerLauncher).

The controller's pool (cluster/control/worker_pool.py) creates the gang: N actors in one
STRICT_PACK placement group, so every rank is on rank 0's node and the group's rendezvous on
127.0.0.1 reaches them all. Rank 0 is the replica actor the rest of the cluster talks to; a
follower only runs the forward of each batch rank 0 sends it (engine/parallel/tp_follower.py),
in a thread of its own so that node() -- the controller's liveness probe -- still answers.
A follower whose driver is gone ends its loop; the pool kills the gang as one unit.

Plain class: worker_pool.py wraps it with ray.remote.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Client
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch: imported by the rank's thread only, never by a TP-1 replica
    from splitserve.engine.parallel.tp_ranks import FollowerLauncher, FollowerStart


class TensorParallelRankActor:
    def __init__(self, replica_id: str, rank: int):
        self.replica_id = replica_id
        self.rank = rank
        self._thread: threading.Thread | None = None

    def start(self, start: FollowerStart) -> None:
        """Dial rank 0, then join the group and serve its commands (returns at once)."""
        if self._thread is not None:
            raise RuntimeError(f"{self.replica_id} rank {self.rank} was started already")
        self._thread = threading.Thread(target=self._run, args=(start,), name=f"tp-rank-{self.rank}", daemon=True)
        self._thread.start()

    def _run(self, start: FollowerStart) -> None:
        from splitserve.engine.parallel.tp_follower import run_follower  # torch

        conn = Client(start.address, authkey=start.authkey)
        conn.send(self.rank)
        # Ray gave this actor its own GPU (CUDA_VISIBLE_DEVICES): it is cuda:0 here, whatever the rank.
        run_follower(
            self.rank,
            start.size,
            start.host,
            start.store_port,
            start.config,
            start.threads,
            conn,
            start.extension,
            own_device=True,
            cores=start.cores,
        )

    def node(self) -> str:
        """The Ray node this rank runs on (the controller's probe and /health)."""
        import ray  # only inside the actor process

        return ray.get_runtime_context().get_node_id()


def launch_rank_actors(handles: list) -> FollowerLauncher:
    """Rank 0's launcher: start each follower actor (handles: ranks 1..N-1, in order)."""

    def launch(start: FollowerStart) -> None:
        for handle in handles:
            handle.start.remote(start)  # not awaited: rank 0 accepts their connections meanwhile

    return launch
