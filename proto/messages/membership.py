"""Pool membership: what the controller tells every ingress about the prefill and decode
replicas (the contract between the controller and the ingress replicas; torch-free).

The controller bumps `version` on every change (a replica added, marked draining, removed)
and answers `membership(seen_version, ingress_id, report, wait_s)` with the current view
when it is newer than `seen_version`, else None. An ingress's MembershipFollower passes the
version it has APPLIED as `seen_version`, so the controller knows which views every ingress
routes by: a drain waits until each live ingress applied the view that marked the replica
draining (no request can still be routed there) and the replica is idle.

Views travel as versioned msgpack (splitserve.proto.messages.codec): no pickle, a clear
error on a view from another build.
"""

from __future__ import annotations

import msgspec

from splitserve.proto.messages.codec import MessageCodec

MEMBERSHIP_VERSION = 1
_codec = MessageCodec(MEMBERSHIP_VERSION)


class ReplicaInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pool: str  # PREFILL | DECODE
    replica_id: str  # == the actor's name in `namespace`, e.g. "decode-3"
    namespace: str  # Ray namespace of the app: ray.get_actor(replica_id, namespace=namespace)
    channel_address: tuple[str, int] | None = None  # decode replicas: their request channel (host, port)
    draining: bool = False  # routes no new requests; in-flight ones finish
    # The actor's id: a replica id can come back as a new actor (a restarted controller
    # numbers from the live ones), and an ingress must not confuse it with the dead one.
    actor_id: str = ""
    # A tensor-parallel replica's ranks' Ray node ids, rank 0 first (for /health); empty for TP 1.
    rank_nodes: tuple[str, ...] = ()


class MembershipView(msgspec.Struct, forbid_unknown_fields=True):
    version: int  # bumps on every change
    replicas: list[ReplicaInfo]
    expected: dict[str, int]  # target replica count per pool (for /health)
    # Per pool, why its last replica start failed while it is below target (e.g. "decode
    # replica needs 4 GPUs on one node ..."), for /health; absent once a start succeeds.
    pending: dict[str, str] = msgspec.field(default_factory=dict)
    # The LoRA adapters the pools serve now (loaded and unloaded at runtime too): the names each
    # ingress's ModelCatalog resolves and /v1/models lists. An adapter being unloaded is out already.
    lora_adapters: list[str] = msgspec.field(default_factory=list)

    def to_bytes(self) -> bytes:
        return _codec.encode("membership_view", self)

    @classmethod
    def from_bytes(cls, data: bytes) -> MembershipView:
        return _codec.decode("membership_view", cls, data)

    def serving(self, pool: str) -> list[ReplicaInfo]:
        """The pool's replicas that take new requests."""
        return [r for r in self.replicas if r.pool == pool and not r.draining]
