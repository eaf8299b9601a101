"""With serve.models the chart makes one worker group per pool of each model, sized and
labelled from that model's merged pool settings exactly as ServeConfig.model_deployments()
merges them in Python (the app's own view), with pod settings from
modelWorkerGroups.<served name>.<pool> over workerGroups.<pool>."""

from __future__ import annotations

import math
import re

import pytest

from splitserve.cluster.config import ServeConfig
from tests.helpers import deploy

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# Value sets exercising the merge: custom resources replaced whole, resources and autoscaling
# merged key by key (false and 0 included), tensor-parallel sizes of a model's own or inherited
# (GPUs per pod scale with them), a pool with no replicas, inherited served names,
# names that are not DNS labels, per-model pod settings and the Ray autoscaler off.
MODEL_VALUE_SETS = {
    "two-gpu-types": {
        "serve": {
            "models": [
                {
                    "model": "/models/small",
                    "served_model_name": "small",
                    "decode": {"resources": {"resources": {"small_decode_gpu": 1}}},
                },
                {
                    "model": "/models/large",
                    "served_model_name": "large",
                    "prefill": {
                        "resources": {"num_gpus": 2, "resources": {"large_prefill_gpu": 1, "nvlink": 0.5}},
                        "autoscaling": {"max_replicas": 6},
                    },
                    "decode": {
                        "tensor_parallel_size": 2,
                        "resources": {"num_gpus": 4, "resources": {"large_decode_gpu": 1}},
                    },
                },
            ]
        },
        "modelWorkerGroups": {
            "large": {
                "decode": {
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                    "replicasPerPod": 2,
                    "resources": {"requests": {"cpu": "8"}, "limits": {"cpu": "8", "memory": "64Gi"}},
                }
            }
        },
    },
    "no-prefill-and-fixed-sizes": {
        "rayAutoscaler": {"enabled": False},
        "serve": {
            "models": [
                {
                    "model": "/models/local-prefill",
                    "prefill": {"replicas": 0, "autoscaling": {"enabled": False}},
                    "decode": {"replicas": 3, "autoscaling": {"enabled": False}},
                },
                {"model": "/models/Org/Model_V2.5", "decode": {"autoscaling": {"min_replicas": 0, "max_replicas": 2}}},
            ]
        },
        "workerGroups": {"decode": {"replicasPerPod": 2}},
    },
    "inherit-everything": {
        "serve": {
            "prefill": {"autoscaling": {"enabled": False}, "replicas": 2, "tensor_parallel_size": 2},
            "models": [
                {"served_model_name": "a" * 70},
                {"model": "/models/b", "served_model_name": "b", "prefill": {"autoscaling": {"enabled": True}}},
            ],
        },
        "modelWorkerGroups": {"b": {"prefill": {"tolerations": [], "shmSize": "16Gi"}}},
    },
}


def _groups(values: dict) -> list[dict]:
    manifests = deploy.render_chart(values)
    (ray_service,) = [o for o in deploy.rendered_objects(manifests) if o["kind"] == "RayService"]
    for obj in deploy.rendered_objects(manifests):
        if obj["kind"] == "RayService":
            try:
                deploy.crd_validator("RayService").validate(obj)
            except pytest.skip.Exception:
                pass  # No CRDs here: test_deploy_helm's CRD test says so (or fails in CI).
    return ray_service["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def _bounds(pool_cfg) -> tuple[int, int]:
    scaling = pool_cfg.autoscaling
    if scaling.enabled:
        return scaling.min_replicas, scaling.max_replicas
    return pool_cfg.replicas, pool_cfg.replicas


@pytest.mark.parametrize("name", sorted(MODEL_VALUE_SETS))
def test_each_models_pools_get_their_own_worker_groups(name):
    given = MODEL_VALUE_SETS[name]
    values = deploy.merged_values(given)
    cfg = ServeConfig.model_validate(values["serve"])
    autoscaler_on = values["rayAutoscaler"]["enabled"]
    groups = _groups(given)
    names = [g["groupName"] for g in groups]
    assert len(set(names)) == len(names)
    expected_names = []
    by_model = {}
    for served, model_cfg in cfg.model_deployments():
        for pool in deploy.POOLS:
            pool_cfg = getattr(model_cfg, pool)
            if _bounds(pool_cfg)[1] == 0:
                continue  # A pool with no replicas gets no group.
            group = groups[len(expected_names)]
            expected_names.append(group["groupName"])
            slug = group["template"]["metadata"]["labels"]["splitserve.io/model"]
            by_model.setdefault(served, slug)
            assert by_model[served] == slug and group["groupName"] == f"{slug}-{pool}"
            assert DNS_LABEL.match(group["groupName"]) and len(group["groupName"]) <= 63
            if DNS_LABEL.match(served) and len(served) <= 48:
                assert slug == served
            assert group["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == pool
            pod_values = dict(values["workerGroups"][pool])
            pod_values.update(values["modelWorkerGroups"].get(served, {}).get(pool, {}))
            _assert_group_hosts_pool(group, pool_cfg, pod_values, autoscaler_on)
    assert names == expected_names
    assert len(set(by_model.values())) == len(by_model)


def _assert_group_hosts_pool(group: dict, pool_cfg, pod_values: dict, autoscaler_on: bool) -> None:
    """The same checks as test_deploy_helm_objects.test_worker_groups_host_their_pools."""
    per_pod = pod_values["replicasPerPod"]
    ranks_per_pod = pool_cfg.tensor_parallel_size * per_pod  # each rank asks the pool's resources
    custom = pool_cfg.resources.resources
    params = group["rayStartParams"]
    if custom:
        assert deploy.parse_ray_resources(params["resources"]) == {k: v * ranks_per_pod for k, v in custom.items()}
    else:
        assert "resources" not in params
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"].get("limits", {})
    assert int(limits.get("nvidia.com/gpu", 0)) == math.ceil(pool_cfg.resources.num_gpus * ranks_per_pod)
    assert {k: v for k, v in limits.items() if k != "nvidia.com/gpu"} == pod_values["resources"].get("limits", {})
    low, high = _bounds(pool_cfg)
    if autoscaler_on:
        expected = (deploy.pods_for(low, per_pod), deploy.pods_for(high, per_pod))
    else:
        expected = (deploy.pods_for(high, per_pod),) * 2
    assert (group["minReplicas"], group["maxReplicas"]) == expected
    assert group["replicas"] == expected[0]
    spec = group["template"]["spec"]
    assert spec.get("nodeSelector", {}) == pod_values["nodeSelector"]
    assert spec.get("tolerations", []) == pod_values["tolerations"]
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"].get("sizeLimit") == pod_values["shmSize"]


def test_the_merge_is_not_vacuous():
    """The value sets above do produce models whose pools differ from the top level's and from
    each other's, so the comparison with model_deployments() can catch a wrong merge."""
    cfg = ServeConfig.model_validate(deploy.merged_values(MODEL_VALUE_SETS["two-gpu-types"])["serve"])
    small, large = (model_cfg for _, model_cfg in cfg.model_deployments())
    assert small.decode.resources.resources == {"small_decode_gpu": 1}
    assert large.prefill.resources.resources == {"large_prefill_gpu": 1, "nvlink": 0.5}
    assert large.prefill.resources.num_cpus == cfg.prefill.resources.num_cpus
    assert large.prefill.autoscaling.enabled and large.prefill.autoscaling.max_replicas == 6
    assert (large.decode.tensor_parallel_size, small.decode.tensor_parallel_size) == (2, 1)
    cfg = ServeConfig.model_validate(deploy.merged_values(MODEL_VALUE_SETS["no-prefill-and-fixed-sizes"])["serve"])
    first, second = (model_cfg for _, model_cfg in cfg.model_deployments())
    assert first.prefill.replicas == 0 and not first.prefill.autoscaling.enabled
    assert second.decode.autoscaling.enabled and second.decode.autoscaling.min_replicas == 0


def test_without_models_the_groups_are_the_two_pools():
    groups = _groups({"serve": {"models": []}})
    assert [g["groupName"] for g in groups] == list(deploy.POOLS)
    assert all("splitserve.io/model" not in g["template"]["metadata"]["labels"] for g in groups)


def test_two_models_served_under_one_name_fail_the_render():
    models = [{"model": "/models/x", "served_model_name": "x"}, {"model": "/models/y", "served_model_name": "x"}]
    with pytest.raises(Exception, match="two models are served as"):
        deploy.render_chart({"serve": {"models": models}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"serve": {"models": [{"model": "/m/x", "served_model_name": "x"}]}, "modelWorkerGroups": {"y": {}}},
            r"modelWorkerGroups.y: no model in serve.models is served as \"y\" \(served: x\)",
        ),
        ({"modelWorkerGroups": {"x": {}}}, "modelWorkerGroups is set but serve.models is empty"),
    ],
)
def test_model_worker_groups_must_name_a_served_model(values, message):
    """A typo in a served name would otherwise leave that model on the default pods unnoticed."""
    with pytest.raises(Exception, match=message):
        deploy.render_chart(values)


def test_a_pool_without_replicas_gets_no_pods():
    """prefill replicas 0 (decode prefills locally) and autoscaling floors of 0 size the pool
    groups at 0 pods, also without serve.models."""
    serve = {
        "prefill": {"replicas": 0, "autoscaling": {"enabled": False}},
        "decode": {"autoscaling": {"enabled": True, "min_replicas": 0, "max_replicas": 3}},
    }
    prefill, decode = _groups({"serve": serve})
    assert (prefill["groupName"], prefill["minReplicas"], prefill["maxReplicas"]) == ("prefill", 0, 0)
    assert (decode["groupName"], decode["minReplicas"], decode["maxReplicas"]) == ("decode", 0, 3)
