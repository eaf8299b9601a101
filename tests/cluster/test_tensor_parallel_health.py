"""/health's tensor-parallel fields, from an ingress's view: each pool's tensor_parallel_size,
a TP replica's ranks' nodes, and why a pool's replica start keeps failing (pending); the view
carries them over the wire."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.pool_health import pool_health
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.proto.messages.membership import MembershipView, ReplicaInfo

pytestmark = pytest.mark.unit
NEED = "decode replica needs 4 GPUs on one node (tensor_parallel_size 4): not placed after 30 s"


def fake_cluster(view: MembershipView, cfg: ServeConfig):
    return SimpleNamespace(
        cfg=cfg,
        follower=SimpleNamespace(view=view),
        live_replicas=lambda pool: len(view.serving(pool)),
        min_replicas={PREFILL: 0, DECODE: 1},
        expected_replicas=dict(view.expected),
    )


def test_health_shows_tp_size_rank_nodes_and_the_pending_need():
    cfg = ServeConfig.model_validate(
        {"prefill": {"replicas": 0, "tensor_parallel_size": 4}, "decode": {"tensor_parallel_size": 4}}
    )
    replica = ReplicaInfo(pool=DECODE, replica_id="decode-0", namespace="ns", rank_nodes=("n1",) * 4)
    view = MembershipView(version=3, replicas=[replica], expected={PREFILL: 0, DECODE: 2}, pending={DECODE: NEED})
    view = MembershipView.from_bytes(view.to_bytes())  # as an ingress receives it
    kv = {PREFILL: {}, DECODE: {}}
    decode = pool_health(fake_cluster(view, cfg), kv)["pools"][DECODE]
    assert decode["tensor_parallel_size"] == 4
    assert decode["ranks"] == {"decode-0": ["n1", "n1", "n1", "n1"]}
    assert decode["pending"] == NEED
    plain = MembershipView(version=1, replicas=[replica.__replace__(rank_nodes=())], expected={DECODE: 1})
    decode = pool_health(fake_cluster(plain, ServeConfig()), kv)["pools"][DECODE]
    assert decode["tensor_parallel_size"] == 1 and "ranks" not in decode and "pending" not in decode
