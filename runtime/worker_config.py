"""WorkerConfig: what a prefill or decode replica actor is built from, one object passed whole
from its pool (cluster/control/worker_pool.py) to the actor's constructor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerConfig:
    engine_config: dict[str, Any] = field(default_factory=dict)  # EngineConfig's fields
    namespace: str | None = None  # the app's Ray namespace: where the peer replicas are named
    transport_host: str = "127.0.0.1"  # the address this replica's KV transport listens on
    transfer_timeout_s: float = 20.0  # a KV transfer's lease: past it the blocks are given up
    torch_threads: int | None = None  # the real engine's torch threads (None: torch's default)
    state_push_interval_s: float = 0.1  # how often the replica pushes its state to its ingresses
    state_heartbeat_s: float = 1.0  # the longest a follower waits for a push while nothing changes
    event_log_size: int = 4096  # recent KV events kept for the ingresses that follow
    reserve_timeout_s: float = 30.0  # decode: how long a remote prefill waits for blocks
    # A tensor-parallel replica's follower rank actors (ranks 1..N-1, runtime/tp_rank_actor.py),
    # created by its pool in the gang's placement group; empty for TP 1.
    tp_followers: tuple = ()
