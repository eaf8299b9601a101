"""Pool membership as the ingresses see it (the contract between the controller, which owns
the pools, and each ingress's Dispatcher). Torch-free, msgspec."""

from __future__ import annotations

import msgspec


class ReplicaInfo(msgspec.Struct, frozen=True):
    pool: str  # PREFILL | DECODE
    replica_id: str  # == actor name, e.g. "decode-3"
    namespace: str  # Ray namespace of the app
    channel_address: tuple[str, int] | None  # decode replicas: their request channel (host, port)
    draining: bool = False


class MembershipView(msgspec.Struct):
    version: int  # bumps on every change
    replicas: list[ReplicaInfo]
    expected: dict[str, int]  # target replica count per pool (for /health)
