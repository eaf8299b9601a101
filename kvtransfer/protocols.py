"""The KV data plane's seam: what a worker sees of a transport, a sender and a posted receive,
whichever implementation is behind them. Torch-free (a simulated replica imports it).

vLLM's KV connector splits a scheduler-side role (which blocks move, to whom) from a
worker-side one (moving the bytes of each layer). Here the prefill and decode workers play the
first role through these three Protocols; the implementations play the second:

    transport                sender                      receive
    KVTransport              KVSender                    PostedReceive          one rank, torch.distributed
    TensorParallelTransport  TensorParallelKVSender      TensorParallelReceive  a replica's ranks, head-routed
    SimulatedTransport       SimulatedKVSender           SimulatedReceive       a timed wait, no tensors

A worker never picks one: its KVDataPlane (data_plane.py, chosen once by the engine kind)
opens the transport and makes the senders and receives that go with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.engine.engine_protocol import EngineProtocol
from splitserve.kvtransfer.send_job import SendJob


class KVTransportProtocol(Protocol):
    """A replica's pairs with its peers, one per peer replica and epoch."""

    @property
    def address(self) -> Any:
        """What a peer's open_pair needs to reach this replica (a receiver passes the sender's)."""
        ...

    def open_pair(self, peer_id: str, peer_address: Any, role: str, epoch: int) -> Any:
        """Open (or reuse) the pair with peer_id, blocking until the peer joins; both ends
        call it concurrently. role: "sender" (prefill) or "receiver" (decode)."""
        ...

    def has_pair(self, peer_id: str) -> bool: ...

    def close_pair(self, peer_id: str, max_epoch: int | None = None) -> bool:
        """Tear down the pair with peer_id (only of epoch <= max_epoch); False if none was open."""
        ...

    def close_idle(self, max_idle_s: float) -> list[str]:
        """Tear down the pairs unused for max_idle_s; returns their peer ids."""
        ...

    def close(self) -> None: ...


class KVSenderProtocol(Protocol):
    """The prefill side: one sender per replica, taking SendJobs in the order they come."""

    total_bytes: int
    total_seconds: float
    num_sends_to_fail: int  # chaos: fail the next N sends

    @property
    def stall_s(self) -> float:
        """Chaos: how long each send stalls first."""
        ...

    @stall_s.setter
    def stall_s(self, seconds: float) -> None: ...

    def layer_callback(self, jobs: Sequence[SendJob]) -> Callable[[int], None]:
        """The per-layer callback of the step that computes these layer-wise jobs' last prompt
        token (their blocks bound): each finished layer goes out."""
        ...

    def send_all(self, job: SendJob) -> None:
        """Queue a whole job (its step is done, its blocks bound)."""
        ...

    def abort(self, job: SendJob) -> Future:
        """Its prefill failed: send no more of its blocks, flush its wire protocol; returns
        job.flushed (True once the pair is in step again)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ReceiveOrder:
    """One transfer as decode posts its receives: from which prefill replica, under which
    transfer id (its tags), into which of this replica's blocks, layer by layer or packed."""

    peer_id: str
    transfer_id: int
    block_ids: tuple[int, ...]
    layerwise: bool


class KVReceiveProtocol(Protocol):
    """The decode side: one transfer's receives, posted before the prefill replica is asked."""

    num_bytes: int

    def complete(self, timeout_s: float) -> tuple[int, float]:
        """Wait until every block landed in the cache. Returns (bytes, seconds); raises
        TransferError on a dead or stalled peer."""
        ...

    def abandon(self, timeout_s: float) -> None:
        """Wait (bounded) until nothing posted can still write into the blocks."""
        ...


class KVDataPlane(Protocol):
    """The three above for one kind of engine; data_plane.py's data_plane_for picks it."""

    def follower_extension(self) -> Callable[..., Any] | None:
        """What each follower rank of a tensor-parallel engine runs beside its forward (its
        share of the data plane: engine/parallel/follower_extension.py), or None."""
        ...

    def open_transport(
        self, replica_id: str, engine: EngineProtocol, host: str, timeout_s: float
    ) -> KVTransportProtocol: ...

    def make_sender(self, transport: Any, engine: EngineProtocol) -> KVSenderProtocol: ...

    def post_receive(self, transport: Any, engine: EngineProtocol, order: ReceiveOrder) -> KVReceiveProtocol: ...
