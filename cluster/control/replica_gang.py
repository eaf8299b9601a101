"""ReplicaGang: the Ray side of a tensor-parallel replica -- N rank actors in one STRICT_PACK
placement group (one bundle per rank, the pool's per-replica resources each), so all ranks
share a node and their group's rendezvous on 127.0.0.1. Rank 0 is the replica actor the
cluster talks to; ranks 1..N-1 are TensorParallelRankActors (runtime/tp_rank_actor.py) that
rank 0 starts and joins. The pool creates, probes and kills the gang as one unit: any rank
lost is the replica lost.

A placement group no node can hold is never waited on for ever: await_placement gives up
after a timeout with a message naming the need ("decode replica needs 4 GPUs on one node"),
and the controller retries with its backoff, the replica pending meanwhile.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import (
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from splitserve.cluster.config import PoolResources

PLACEMENT_TIMEOUT_S = 30.0  # how long a replica's placement group may stay unplaced per try
NODE_PROBE_TIMEOUT_S = 10.0


def placement_group_name(namespace: str, replica_id: str) -> str:
    return f"{namespace}/{replica_id}"


def rank_bundle(resources: PoolResources) -> dict[str, float]:
    """One rank's bundle: the pool's per-replica resources (a TP-N replica asks N of them)."""
    bundle = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.resources}
    return {name: amount for name, amount in bundle.items() if amount > 0}


def placement_need(pool: str, resources: PoolResources, size: int) -> str:
    """What one replica needs of one node, e.g. 'decode replica needs 4 GPUs and 4 CPUs on one node'."""
    totals = [f"{amount * size:g} {name}s" for name, amount in rank_bundle(resources).items()]
    order = sorted(totals, key=lambda text: "GPU" not in text)  # GPUs first: what users size by
    return f"{pool} replica needs {' and '.join(order)} on one node (tensor_parallel_size {size})"


@dataclass
class ReplicaGang:
    size: int
    placement_group: Any
    need: str  # placement_need's message
    followers: list = field(default_factory=list)  # ranks 1..N-1
    nodes: list[str] = field(default_factory=list)  # each rank's Ray node id, once placed
    broken: str | None = None  # why the gang cannot serve, found without a probe

    @classmethod
    def create(cls, pool: str, replica_id: str, namespace: str, resources: PoolResources, size: int, follower_cls):
        """The placement group (detached, like the actors) and ranks 1..N-1, scheduled into it;
        rank 0 is the caller's to create with rank0_strategy()."""
        bundle = rank_bundle(resources) or {"CPU": 0.01}  # Ray refuses empty bundles
        group = placement_group(
            [dict(bundle) for _ in range(size)],
            strategy="STRICT_PACK",
            lifetime="detached",
            name=placement_group_name(namespace, replica_id),
        )
        gang = cls(size, group, placement_need(pool, resources, size))
        remote = ray.remote(follower_cls)
        for rank in range(1, size):
            gang.followers.append(
                remote.options(
                    name=f"{replica_id}-rank-{rank}",
                    namespace=namespace,
                    lifetime="detached",
                    max_restarts=0,
                    max_concurrency=4,  # node() answers while the rank serves its steps
                    num_cpus=resources.num_cpus,
                    num_gpus=resources.num_gpus,
                    resources=dict(resources.resources) or None,
                    scheduling_strategy=gang.strategy(rank),
                ).remote(replica_id, rank)
            )
        return gang

    @classmethod
    def adopt(cls, pool: str, replica_id: str, namespace: str, resources: PoolResources, size: int):
        """A live gang left by a previous controller, found by its names; a rank not found marks
        it broken (the next probe replaces the replica)."""
        try:
            group = get_placement_group(placement_group_name(namespace, replica_id))
        except ValueError:
            group = None  # made where its name is not visible: the replica's kill leaves it
        gang = cls(size, group, placement_need(pool, resources, size))
        for rank in range(1, size):
            try:
                gang.followers.append(ray.get_actor(f"{replica_id}-rank-{rank}", namespace=namespace))
            except ValueError:
                gang.broken = f"tensor-parallel rank {rank} is gone"
        return gang

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)

    async def await_placement(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.placement_group.ready(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.need}: not placed after {timeout_s:.0f} s") from None

    def placed_nodes(self) -> list[str]:
        """Each rank's node id (its bundle's), once the placement group is ready."""
        table = placement_group_table(self.placement_group)
        by_bundle = table.get("bundles_to_node_id", {})
        return [by_bundle.get(rank, "") for rank in range(self.size)]

    async def probe_followers(self, timeout_s: float = NODE_PROBE_TIMEOUT_S) -> str | None:
        """None when every follower answers; else why the gang is broken."""
        if self.broken is not None:
            return self.broken
        for rank, handle in enumerate(self.followers, start=1):
            try:
                await asyncio.wait_for(handle.node.remote(), timeout_s)
            except ray.exceptions.RayActorError:
                return f"tensor-parallel rank {rank} died"
            except (TimeoutError, ray.exceptions.RayError):
                continue  # busy or slow: not dead; rank 0's collectives time out if it hangs
        return None

    def kill(self) -> None:
        """End the followers and free the placement group (blocking)."""
        for handle in self.followers:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        if self.placement_group is None:
            return
        try:
            remove_placement_group(self.placement_group)
        except Exception:
            pass
