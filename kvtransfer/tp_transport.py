"""TensorParallelTransport: a real engine's replica-level transport (KVTransportProtocol), over
all its ranks -- rank 0's own KVTransport here, each follower rank's in its RankKVPlane
(rank_kv_plane.py), told what to do through a FollowerLink.

A pair with a peer replica is the set of rank pairs its head map calls for (head_map.py):
rank p of the prefill replica with rank d of the decode replica when p sends d some of d's KV
heads. Opening it opens them all, each rank its own, concurrently; it is open once all are.
Its address (ReplicaKVAddress) tells a peer the replica's KV layout and where each rank's
rendezvous listens. With both replicas at TP 1 it is exactly one rank pair, the replica ids
its endpoints, as a KVTransport alone would open.

Rank 0's pairs stand for the replica's: rank 0 pairs with the peer's rank 0 whatever the sizes,
and every transfer uses it, so when rank 0's pairs with a peer go idle (close_idle) or fail,
the whole pair with that peer is closed, followers included.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.kvtransfer.errors import TransferError, TransportUsageError
from splitserve.kvtransfer.follower_link import FollowerLink, wait_answers
from splitserve.kvtransfer.head_map import SENDER, KVLayout, KVRoute, rank_routes
from splitserve.kvtransfer.rank_commands import CloseRankPairs, InitRank, OpenRankPairs, RankStats, ReplicaKVAddress
from splitserve.kvtransfer.transfer_stats import TransferStats
from splitserve.kvtransfer.transport import KVTransport

_ANSWER_MARGIN_S = 10.0  # a follower's answer may trail its own timeout by this much


def open_routes(
    transport: KVTransport, routes: Sequence[KVRoute], peer: ReplicaKVAddress, role: str, epoch: int
) -> None:
    """Open one rank's pairs for its routes with the peer replica, concurrently (each blocks
    until the peer's rank joins, and the peer's ranks open theirs in their own order)."""
    errors: list[Exception] = []

    def open_one(route: KVRoute) -> None:
        address = None if role == SENDER else peer.ranks[route.peer_rank]
        try:
            transport.open_pair(route.endpoint, address, role, epoch)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(route,), daemon=True) for route in routes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@dataclass
class _Peer:
    epoch: int
    routes: list[KVRoute]  # rank 0's


class TensorParallelTransport:
    def __init__(
        self,
        replica_id: str,
        device: torch.device | str,
        host: str,
        timeout_s: float,
        layout: KVLayout,
        followers: FollowerLink | None = None,
    ):
        self.replica_id = replica_id
        self.layout = layout
        self.followers = followers
        self.timeout_s = timeout_s
        self.local = KVTransport(replica_id, device, host=host, timeout_s=timeout_s)
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._follower_addresses: list = []
        if followers is not None:
            init = followers.request(lambda number: InitRank(number, replica_id, host, timeout_s, layout))
            self._follower_addresses = wait_answers(init, timeout_s + _ANSWER_MARGIN_S, f"{replica_id}'s KV ranks")

    @property
    def address(self) -> ReplicaKVAddress:
        return ReplicaKVAddress(self.layout, (self.local.address, *self._follower_addresses))

    @property
    def max_timeout_s(self) -> float:
        return self.local.max_timeout_s

    def open_pair(self, peer_id: str, peer_address: ReplicaKVAddress | None, role: str, epoch: int) -> None:
        """Open every rank pair with peer_id (peer_address: its transport's address, on both
        sides: the sender needs the receiver's layout, the receiver also its ranks' addresses)."""
        if not isinstance(peer_address, ReplicaKVAddress):
            raise TransportUsageError(f"open_pair with {peer_id!r} needs its ReplicaKVAddress, got {peer_address!r}")
        routes = rank_routes(self.layout, peer_address.layout, role, 0, peer_id)
        with self._lock:
            known = self._peers.get(peer_id)
        if known is not None and known.epoch == epoch and self.has_pair(peer_id):
            return
        opened = []
        if self.followers is not None:
            opened = self.followers.request(lambda number: OpenRankPairs(number, peer_id, peer_address, role, epoch))
        try:
            open_routes(self.local, routes, peer_address, role, epoch)
            wait_answers(opened, self.timeout_s + _ANSWER_MARGIN_S, f"pair {self.replica_id} with {peer_id}")
        except BaseException:
            self._close_ranks(peer_id, routes, None)
            raise
        with self._lock:
            self._peers[peer_id] = _Peer(epoch, routes)

    def rank_routes(self, peer_id: str) -> list[KVRoute]:
        """Rank 0's routes with peer_id (the senders and receives of this rank follow them)."""
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(f"no open pair between {self.replica_id!r} and {peer_id!r}; call open_pair")
        return peer.routes

    def has_pair(self, peer_id: str) -> bool:
        with self._lock:
            peer = self._peers.get(peer_id)
        return peer is not None and all(self.local.has_pair(route.endpoint) for route in peer.routes)

    def close_pair(self, peer_id: str, max_epoch: int | None = None) -> bool:
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None or (max_epoch is not None and peer.epoch > max_epoch):
                return False
            del self._peers[peer_id]
        return self._close_ranks(peer_id, peer.routes, max_epoch)

    def _close_ranks(self, peer_id: str, routes: list[KVRoute], max_epoch: int | None) -> bool:
        was_open = False
        for route in routes:
            was_open |= self.local.close_pair(route.endpoint, max_epoch)
        if self.followers is not None:
            try:
                self.followers.command(CloseRankPairs(peer_id, max_epoch))
            except TransferError:
                pass  # the ranks are gone: so are their pairs
        return was_open

    def close_idle(self, max_idle_s: float) -> list[str]:
        """Close the pairs whose rank 0 pairs went unused for max_idle_s; returns their peers."""
        idle = set(self.local.close_idle(max_idle_s))
        with self._lock:
            peers = [peer for peer, state in self._peers.items() if any(r.endpoint in idle for r in state.routes)]
        for peer in peers:
            self.close_pair(peer)
        return sorted(peers)

    def stats(self) -> TransferStats:
        """Rank 0's totals (rank_stats: every rank's)."""
        return self.local.stats()

    def rank_stats(self) -> list[TransferStats]:
        """Each rank's transport totals, in rank order: what crossed the wire, rank by rank."""
        stats = [self.local.stats()]
        if self.followers is not None:
            stats += wait_answers(self.followers.request(RankStats), self.timeout_s, "KV rank stats")
        return stats

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            self.close_pair(peer)
        self.local.close()
