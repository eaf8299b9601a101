"""Which KV heads go from which prefill rank to which decode rank, when a prefill replica of
tensor_parallel_size a sends a prompt's blocks to a decode replica of size b (torch-free).

Each decode rank d receives exactly the KV heads it holds (engine/parallel/shard_plan.py's
kv_head_range), each from one prefill rank that holds it: a > b, several prefill ranks each
send d a slice of its heads; a < b, one prefill rank sends each of several decode ranks a slice
of its own; a == b, rank i sends rank i its blocks as stored. A head held by several prefill
ranks (replicated: TP > KV heads) is drawn from the holder d picks (d modulo the holders), so
decode ranks spread over the replicas and a prefill rank nobody picks sends nothing. Every
head a decode rank keeps crosses the wire once for that rank, and nothing else crosses it.

Rank 0 always pairs with rank 0 (decode rank 0's first head comes from prefill rank 0), so a
replica's pair with a peer is alive exactly when its rank 0's is (tp_transport.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.config import ConfigError
from splitserve.engine.parallel.shard_plan import kv_head_range

SENDER, RECEIVER = "sender", "receiver"  # a pair's roles: prefill sends, decode receives


def rank_endpoint(replica_id: str, rank: int) -> str:
    """Rank r's transport endpoint: rank 0 is the replica itself (so TP 1 pairs are as they
    were), rank r its gang's rank actor's name."""
    return replica_id if rank == 0 else f"{replica_id}-rank-{rank}"


@dataclass(frozen=True)
class KVLayout:
    """How a replica's ranks split the model's KV heads."""

    num_kv_heads: int  # the whole model's
    tensor_parallel_size: int

    def heads(self, rank: int) -> range:
        return kv_head_range(self.num_kv_heads, self.tensor_parallel_size, rank)


@dataclass(frozen=True)
class HeadRoute:
    """What one prefill rank sends one decode rank: heads [start, stop) of the model, which are
    [prefill_start, ...) on the prefill rank and [decode_start, ...) on the decode rank."""

    prefill_rank: int
    decode_rank: int
    start: int
    stop: int
    prefill_start: int
    decode_start: int
    whole: bool  # both ranks hold exactly these heads: the blocks go as stored

    @property
    def num_heads(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class KVRoute:
    """One rank's side of a HeadRoute: the peer rank's endpoint and its own local heads."""

    endpoint: str
    peer_rank: int
    head_start: int
    num_heads: int
    whole: bool


def check_head_map(num_kv_heads: int, prefill_size: int, decode_size: int) -> None:
    """A one-line ConfigError naming the numbers when the two sizes cannot share the KV heads."""
    for side, size in (("prefill", prefill_size), ("decode", decode_size)):
        if size < 1 or (num_kv_heads % size and size % num_kv_heads):
            raise ConfigError(
                f"prefill tensor_parallel_size {prefill_size} and decode tensor_parallel_size {decode_size} "
                f"cannot map the model's {num_kv_heads} KV heads: the {side} size {size} neither divides "
                f"{num_kv_heads} nor is a multiple of it"
            )


def head_routes(prefill: KVLayout, decode: KVLayout) -> list[HeadRoute]:
    """Every (prefill rank, decode rank) transfer, decode rank by decode rank."""
    if prefill.num_kv_heads != decode.num_kv_heads:
        raise ConfigError(
            f"prefill holds a model of {prefill.num_kv_heads} KV heads, decode one of {decode.num_kv_heads}: "
            "KV moves only between replicas of one model"
        )
    check_head_map(prefill.num_kv_heads, prefill.tensor_parallel_size, decode.tensor_parallel_size)
    routes = []
    for d in range(decode.tensor_parallel_size):
        d_heads = decode.heads(d)
        sources = []  # (prefill rank, head), in head order
        for head in d_heads:
            holders = [p for p in range(prefill.tensor_parallel_size) if head in prefill.heads(p)]
            sources.append((holders[d % len(holders)], head))
        start = 0
        while start < len(sources):  # runs of consecutive heads from one prefill rank
            p, first = sources[start]
            stop = start
            while stop < len(sources) and sources[stop][0] == p:
                stop += 1
            last = sources[stop - 1][1] + 1
            p_heads = prefill.heads(p)
            whole = p_heads == range(first, last) == d_heads
            routes.append(HeadRoute(p, d, first, last, first - p_heads.start, first - d_heads.start, whole))
            start = stop
    return routes


def rank_routes(own: KVLayout, peer: KVLayout, role: str, rank: int, peer_id: str) -> list[KVRoute]:
    """What rank `rank` of a replica (role: SENDER for prefill) moves with peer replica
    peer_id: one KVRoute per peer rank it pairs with, in route order."""
    prefill, decode = (own, peer) if role == SENDER else (peer, own)
    found = []
    for route in head_routes(prefill, decode):
        mine, theirs, start = (
            (route.prefill_rank, route.decode_rank, route.prefill_start)
            if role == SENDER
            else (route.decode_rank, route.prefill_rank, route.decode_start)
        )
        if mine == rank:
            found.append(KVRoute(rank_endpoint(peer_id, theirs), theirs, start, route.num_heads, route.whole))
    return found
