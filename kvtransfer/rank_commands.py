"""What a tensor-parallel replica's driver (rank 0) tells its follower ranks' KV planes
(rank_kv_plane.py), and what they answer. Each crosses the follower's pipe pickled
(engine/parallel/follower_extension.py): commands between forwards, SendLayers riding on the
forward whose layers it sends. A command that expects an answer carries a `number`; the
follower answers Reply(number, ...) once it is done (follower_link.py matches them up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.kvtransfer.head_map import KVLayout
from splitserve.kvtransfer.protocols import ReceiveOrder
from splitserve.kvtransfer.rendezvous import Address


@dataclass(frozen=True)
class ReplicaKVAddress:
    """A replica's transport as a peer sees it (TensorParallelTransport.address): how its ranks
    split the KV heads, and each rank's rendezvous address (a receiver dials the sender's)."""

    layout: KVLayout
    ranks: tuple[Address, ...]


@dataclass(frozen=True)
class InitRank:
    """Open this rank's transport (endpoint head_map.rank_endpoint(replica_id, rank)); answers
    its rendezvous address."""

    number: int
    replica_id: str
    host: str
    timeout_s: float
    layout: KVLayout


@dataclass(frozen=True)
class OpenRankPairs:
    """Open this rank's pairs with peer replica peer_id (its routes, head_map.rank_routes);
    answers None once open."""

    number: int
    peer_id: str
    peer: ReplicaKVAddress
    role: str
    epoch: int


@dataclass(frozen=True)
class CloseRankPairs:
    peer_id: str
    max_epoch: int | None  # only pairs of that epoch or older


@dataclass(frozen=True)
class RankSend:
    """One job, as each rank sends its own heads of it (SendJob's fields); answers
    (bytes, seconds) once its last layer is out."""

    number: int
    request_id: str
    peer_id: str
    transfer_id: int
    block_ids: tuple[int, ...]
    layerwise: bool
    num_blocks: int


@dataclass(frozen=True)
class SendLayers:
    """A forward's work: the layer-wise jobs whose last prompt token that forward computes."""

    jobs: tuple[RankSend, ...]


@dataclass(frozen=True)
class SendWhole:
    """A packed job whose step is done: send it whole."""

    job: RankSend


@dataclass(frozen=True)
class AbortSend:
    """The job's prefill failed: send filler for its layers not sent yet; answers True once
    the pairs are in step."""

    number: int
    job: RankSend


@dataclass(frozen=True)
class RankReceive:
    """Post this rank's receives of one transfer; answers (bytes, seconds) once it landed."""

    number: int
    order: ReceiveOrder


@dataclass(frozen=True)
class RankStats:
    """Answers this rank's transport's TransferStats."""

    number: int


@dataclass(frozen=True)
class Reply:
    number: int
    value: Any = None
    error: str | None = None  # the failure, in one line
