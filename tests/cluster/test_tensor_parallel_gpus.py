"""Each rank of a served tensor-parallel replica gets a GPU of its own: the pool's gang asks Ray
for num_gpus per rank, and Ray sets every rank actor's CUDA_VISIBLE_DEVICES to the one GPU it
assigned it, so each rank's cuda:0 (engine/parallel/tp_group.rank_device with own_device) is a
different GPU. Ray is started with two GPUs it believes in (none here): the assignment and the
environment are Ray's real ones; tests/engine/test_tensor_parallel_devices.py covers which
device a rank then picks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

SCRIPT = textwrap.dedent(
    """
    import json, os
    import ray
    from splitserve.cluster.config import PoolResources
    from splitserve.cluster.control.worker_pool import WorkerPool
    from splitserve.runtime.worker_config import WorkerConfig

    class ReplicaActor:  # stands in for rank 0's engine worker: only its placement matters here
        def __init__(self, replica_id, worker):
            pass

    def seen(actor):
        return os.environ.get("CUDA_VISIBLE_DEVICES"), [str(g) for g in ray.get_gpu_ids()]

    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="ERROR", log_to_driver=False, namespace="tp-gpus")
    try:
        worker = WorkerConfig(engine_config={"tensor_parallel_size": 2}, namespace="tp-gpus")
        pool = WorkerPool("decode", ReplicaActor, worker, PoolResources(num_cpus=0.5, num_gpus=1))
        replica = pool.start_replica()
        ranks = [replica.handle, *replica.gang.followers]
        print(json.dumps(ray.get([r.__ray_call__.remote(seen) for r in ranks], timeout=120)))
        pool.stop()
    finally:
        ray.shutdown()
    """
)


def test_each_rank_of_a_gang_sees_its_own_gpu():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(per_rank) == 2
    for visible, assigned in per_rank:
        assert visible == ",".join(assigned) and len(assigned) == 1  # one GPU, and it is the one visible
    assert {visible for visible, _ in per_rank} == {"0", "1"}  # two different GPUs
