"""pool_health: one model's /health state from an ingress's view of its pools."""

from __future__ import annotations

from typing import Any

from splitserve.cluster.control.disagg_cluster import DisaggCluster
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL


def pool_health(cluster: DisaggCluster, kv_caches: dict[str, dict[str, Any]]) -> dict:
    """Each pool's live (routable) and expected replica counts and its floor (`min`: its
    configured replicas, or min_replicas when it autoscales). Not ok while a pool is below
    its floor or no decode replica serves; `degraded` and `reason` then name the pools.
    `serving`: requests can be served at all (a decode replica is live; without prefill
    replicas decode prefills itself) -- what a probe deciding on restarts should read."""
    pools: dict[str, dict[str, Any]] = {}
    view = cluster.follower.view
    for pool in (PREFILL, DECODE):
        live, floor = cluster.live_replicas(pool), cluster.min_replicas[pool]
        expected = max(cluster.expected_replicas.get(pool, 0), floor)
        pools[pool] = {
            "ok": live >= floor,
            "live": live,
            "expected": expected,
            "min": floor,
            "kv_cache": kv_caches[pool],
            "tensor_parallel_size": (
                cluster.cfg.prefill if pool == PREFILL else cluster.cfg.decode
            ).tensor_parallel_size,
        }
        ranks = {
            r.replica_id: list(r.rank_nodes) for r in (view.replicas if view else []) if r.pool == pool and r.rank_nodes
        }
        if ranks:
            pools[pool]["ranks"] = ranks
        if view is not None and pool in view.pending:
            pools[pool]["pending"] = view.pending[pool]
    degraded = [pool for pool, state in pools.items() if not state["ok"]]
    if not pools[DECODE]["live"] and DECODE not in degraded:
        degraded.append(DECODE)
    state: dict[str, Any] = {
        "ok": not degraded,
        "serving": pools[DECODE]["live"] > 0,
        "prefill_replicas": pools[PREFILL]["live"],
        "decode_replicas": pools[DECODE]["live"],
        "pools": pools,
    }
    if degraded:
        state["degraded"] = degraded
        state["reason"] = "; ".join(
            f"the {pool} pool has {pools[pool]['live']} live replica(s) of {pools[pool]['expected']} expected "
            f"(min {pools[pool]['min']})"
            for pool in degraded
        )
    return state
