"""The controller's per-replica series: a replica that left (drained, died, its engine loop
stopped) is no longer exported, whatever family carries it."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from tests.helpers.engine_stats import STATS

REPLICAS = [("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")]


def exported_replicas(metrics: PoolMetrics) -> dict[str, set[str]]:
    """family name -> the replicas it exports a series for."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if "replica" in sample.labels:
                out.setdefault(family.name, set()).add(sample.labels["replica"])
    return out


def test_a_removed_replica_exports_no_series():
    metrics = PoolMetrics("tiny")
    poll = PollReply([], STATS, 0, 1, TransferTotals(num_blocks=2, num_bytes=4096, seconds=0.01))
    for pool, replica_id in REPLICAS:
        metrics.observe_poll(pool, replica_id, poll)
    before = exported_replicas(metrics)
    assert before and all(ids == {r for _, r in REPLICAS} for ids in before.values())
    # Every family labelled by replica is one forget_replica reaches.
    assert set(before) <= {m.name for family in metrics.per_replica for m in family.describe()}

    metrics.forget_replica("decode", "decode-1")
    after = exported_replicas(metrics)
    assert set(after) == set(before)
    assert all(ids == {"prefill-0", "decode-0"} for ids in after.values())
    metrics.forget_replica("decode", "decode-1")  # twice, or a replica never seen: harmless
    metrics.forget_replica("prefill", "prefill-9")
    metrics.forget_replica("prefill", "prefill-0")
    metrics.forget_replica("decode", "decode-0")
    assert exported_replicas(metrics) == {}
