"""A tensor-parallel pool autoscaled as a pool of gangs on local Ray: a TP-2 decode pool (its
replicas prefilling their own prompts) under a closed-loop load that rises then falls scales
1 -> 2 -> 1 replicas -- each replica two rank actors in a placement group of their own, added
and drained as one unit -- with no request failed, the new gang serving, the removed gang's
rank actors gone, and every pool back at baseline."""

from __future__ import annotations

import pytest
from ray.util.placement_group import placement_group_table

from splitserve.bench.control_plane.autoscale_load import ClosedLoopLoad
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.cluster.control.worker_pool import named_actors
from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.cluster.scaling.autoscaler import Autoscaler
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.cluster.scaling.test_autoscaling import QUICK_DECODE_SCALING, prompt, rise_and_fall, serving, wait_until
from tests.helpers.cluster import start_cluster, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tp_cluster(ray_cluster, tiny_model, loop):
    cfg = ServeConfig.model_validate(
        {
            "model": tiny_model,
            "prefill": {"replicas": 0},
            "decode": {
                "replicas": 1,
                "tensor_parallel_size": 2,
                "num_kv_blocks": 64,
                "resources": {"num_cpus": 1},
                "torch_threads": 1,
                "autoscaling": QUICK_DECODE_SCALING,
            },
        }
    )
    cluster = start_cluster(loop, cfg)
    yield cluster
    loop.run(cluster.shutdown(), timeout=60)


def test_a_tp2_pool_scales_up_and_back_down_as_whole_gangs(loop, tp_cluster):
    cluster = tp_cluster
    pool = cluster.pools[DECODE]
    namespace = pool.namespace
    (first,) = pool.live_replicas()
    assert first.gang is not None and first.gang.size == 2
    load = ClosedLoopLoad(
        cluster,
        lambda i: prompt(i, 48),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        max_concurrency=8,
        latency_window_s=1.0,
    )
    autoscaler = Autoscaler(
        cluster, cluster.cfg, PoolMetrics("tiny"), latency_source=load.latency_ms, drain_timeout_s=60
    )
    added: dict = {}

    def at(num: int) -> bool:
        idle = not autoscaler.scaling_in_progress(DECODE)
        return idle and len(serving(cluster, DECODE)) == num == len(cluster.router.replica_ids(DECODE))

    def second_gang_served() -> bool:
        others = [r for r in pool.live_replicas() if r.replica_id != first.replica_id]
        if others:
            added["replica"] = others[0]
            added["gang"] = others[0].gang
        return bool(others) and others[0].replica_id in load.replicas_used

    loop.run(rise_and_fall(autoscaler, load, 8, at, second_gang_served, timeout_s=90), timeout=300)
    assert load.num_failed == 0, load.failures
    assert load.num_ok > 0 and set(load.finish_reasons) == {"length"}
    events = [(e.action, e.from_replicas, e.to_replicas) for e in autoscaler.events if e.pool == DECODE]
    assert events == [("up", 1, 2), ("down", 2, 1)], autoscaler.events
    second = added["replica"]
    assert added["gang"] is not None and added["gang"].size == 2 and len(set(added["gang"].nodes)) == 1
    (left,) = pool.live_replicas()
    removed = second if left.replica_id == first.replica_id else first
    gone = {removed.replica_id, f"{removed.replica_id}-rank-1"}
    wait_until_sync = lambda: not gone & set(named_actors(namespace))  # noqa: E731
    loop.run(wait_until(wait_until_sync, None, "the removed gang's rank actors to exit"), timeout=40)
    state = placement_group_table(removed.gang.placement_group)["state"]
    assert state == "REMOVED", state
    assert left.gang is not None and f"{left.replica_id}-rank-1" in named_actors(namespace)
    wait_for_baseline(loop, cluster)
