"""The Helm chart's rendered objects wire the deployment up: every node gets the front door's
env, worker groups host their pools, volumes are mounted where serve reads them, the Service
exposes the frontends, monitoring targets it and the dashboard charts metrics the app has.
Each test runs for the chart's default values and for every helm/splitserve/ci/*.yaml (see
test_deploy_helm.py)."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.grpc.health import READY_SERVICE
from tests.helpers import deploy
from tests.helpers.deploy import merged_values_of, objects_of, ray_service_of

POOLS = deploy.POOLS
VALUE_SETS = deploy.value_set_names()
# The metrics the Grafana dashboard must chart (names as Prometheus exposes them).
DASHBOARD_METRICS = (
    "splitserve_ttft_seconds",
    "splitserve_itl_seconds",
    "splitserve_e2e_seconds",
    "splitserve_requests_total",
    "splitserve_queue_depth",
    "splitserve_running_requests",
    "splitserve_kv_block_usage",
    "splitserve_prefix_cache_hit_tokens_total",
    "splitserve_kv_transfer_bytes_total",
    "splitserve_kv_transfer_seconds",
    "splitserve_router_decisions_total",
    "splitserve_replicas",
)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_head_and_every_worker_group_get_the_front_door_env(name):
    """HAProxy ingress + throughput-optimized Serve: every node that can host an ingress
    replica reads the same flags at start-up (values.frontDoor)."""
    front_door = merged_values_of(name)["frontDoor"]
    cluster = ray_service_of(name)["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert len(templates) == 1 + len(POOLS)
    for template in templates:
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
        assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == str(front_door["drainingPeriodS"])
        assert env["RAY_SERVE_HAPROXY_NBTHREAD"] == str(front_door["haproxyThreads"])
        serve_values = merged_values_of(name)["serve"]
        assert env["RAY_SERVE_HAPROXY_MAXCONN"] == str(serve_values["http_max_connections"])
        assert env["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] == str(math.ceil(serve_values["http_request_timeout_s"]))
        for check in ("READY", "HEALTH"):
            assert env[f"RAY_SERVE_PROXY_{check}_CHECK_TIMEOUT_S"] == str(front_door["proxyCheckTimeoutS"])
    off = deploy.render_chart({"frontDoor": {"haproxy": False}, "head": {"extraEnv": [{"name": "X", "value": "1"}]}})
    head = next(o for o in deploy.rendered_objects(off) if o["kind"] == "RayService")
    head = head["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["env"] == [{"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "0"}, {"name": "X", "value": "1"}]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_a_worker_pod_drains_its_replicas_before_it_stops(name):
    """Every worker pod's preStop hook is `splitserve drain-node` (SIGTERM to each replica,
    which the controller then drains: cluster/cli/drain_node.py), waiting less than the pod's
    grace period; the head, which hosts no replica, has none."""
    cluster = ray_service_of(name)["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["splitserve", "drain-node"] and command[2] == "--timeout-s"
        assert float(command[3]) < spec["terminationGracePeriodSeconds"]
    assert "lifecycle" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_worker_groups_host_their_pools(name):
    values = merged_values_of(name)
    cluster = ray_service_of(name)["spec"]["rayClusterConfig"]
    autoscaler_on = values["rayAutoscaler"]["enabled"]
    assert cluster["enableInTreeAutoscaling"] is autoscaler_on
    head_params = cluster["headGroupSpec"]["rayStartParams"]
    assert "resources" not in head_params
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == set(POOLS)
    cfg = ServeConfig.model_validate(values["serve"])
    for pool in POOLS:
        pool_cfg, group = getattr(cfg, pool), groups[pool]
        per_pod = values["workerGroups"][pool]["replicasPerPod"]
        ranks_per_pod = pool_cfg.tensor_parallel_size * per_pod  # each rank asks the pool's resources
        custom = pool_cfg.resources.resources
        params = group["rayStartParams"]
        if custom:
            advertised = deploy.parse_ray_resources(params["resources"])
            assert advertised == {k: v * ranks_per_pod for k, v in custom.items()}
        else:
            assert "resources" not in params
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"].get("limits", {})
        num_gpus = math.ceil(pool_cfg.resources.num_gpus * ranks_per_pod)
        assert int(limits.get("nvidia.com/gpu", 0)) == num_gpus
        assert deploy.quantity(limits["cpu"]) >= pool_cfg.resources.num_cpus * ranks_per_pod
        scaling = pool_cfg.autoscaling
        low, high = (
            (scaling.min_replicas, scaling.max_replicas) if scaling.enabled else (pool_cfg.replicas, pool_cfg.replicas)
        )
        if autoscaler_on:
            expected = (deploy.pods_for(low, per_pod), deploy.pods_for(high, per_pod))
        else:
            expected = (deploy.pods_for(high, per_pod),) * 2
        assert (group["minReplicas"], group["maxReplicas"]) == expected
        assert group["replicas"] == expected[0]
        spec = group["template"]["spec"]
        group_values = values["workerGroups"][pool]
        assert spec.get("nodeSelector", {}) == group_values["nodeSelector"]
        assert spec.get("tolerations", []) == group_values["tolerations"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_model_volume_is_mounted_at_serve_model(name):
    values = merged_values_of(name)
    source = values["model"]["source"]
    ray_service = ray_service_of(name)
    claims = {o["metadata"]["name"] for o in objects_of(name, "PersistentVolumeClaim")}
    downloads = source == "download" or (source == "pvc" and values["model"]["pvc"]["populate"])
    for group, template in deploy.iter_ray_pod_templates(ray_service):
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", []) if m["name"] == "model"]
        if source == "image":
            assert "model" not in volumes and not mounts
            continue
        assert [m["mountPath"] for m in mounts] == [values["serve"]["model"]], group
        assert mounts[0]["subPath"] == values["model"]["subPath"] and mounts[0]["readOnly"]
        kind = {"download": "emptyDir", "pvc": "persistentVolumeClaim", "hostPath": "hostPath"}[source]
        assert kind in volumes["model"], group
        if source == "pvc":
            claim = volumes["model"]["persistentVolumeClaim"]["claimName"]
            assert claim in claims or claim == values["model"]["pvc"]["existingClaim"]
        init_names = [c["name"] for c in spec.get("initContainers", [])]
        assert ("model-download" in init_names) is downloads, group


@pytest.mark.parametrize("name", VALUE_SETS)
def test_state_volume_is_mounted_read_write_at_state_dir(name):
    values = merged_values_of(name)
    claims = {o["metadata"]["name"] for o in objects_of(name, "PersistentVolumeClaim")}
    for group, template in deploy.iter_ray_pod_templates(ray_service_of(name)):
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", []) if m["name"] == "state"]
        assert [m["mountPath"] for m in mounts] == [values["serve"]["state_dir"]], group
        assert not mounts[0].get("readOnly")
        assert volumes["state"]["persistentVolumeClaim"]["claimName"] in claims, group


def test_state_url_mounts_no_state_volume():
    objects = deploy.rendered_objects(
        deploy.render_chart({"serve": {"state_url": "postgresql+psycopg://u@db/splitserve"}})
    )
    claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"].endswith("-state")]
    assert claims == []
    (ray_service,) = [o for o in objects if o["kind"] == "RayService"]
    for group, template in deploy.iter_ray_pod_templates(ray_service):
        assert "state" not in {v["name"] for v in template["spec"]["volumes"]}, group
    args = yaml.safe_load(ray_service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["state_url"] == "postgresql+psycopg://u@db/splitserve"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_service_exposes_the_head_frontends(name):
    (service,) = objects_of(name, "Service")
    values = merged_values_of(name)
    serve = values["serve"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "http": serve["http_port"],
        "grpc": serve["grpc_port"],
    }
    templates = dict(deploy.iter_ray_pod_templates(ray_service_of(name)))
    selector = service["spec"]["selector"].items()
    assert selector <= templates["head"]["metadata"]["labels"].items()
    for pool in POOLS:
        assert not selector <= templates[pool]["metadata"]["labels"].items()
    (head,) = templates["head"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    for port in service["spec"]["ports"]:
        assert container_ports[port["targetPort"]] == port["port"]
    assert container_ports["serve"] == serve["http_port"]  # KubeRay's serve Service uses it
    if values["head"]["probes"]["enabled"]:
        # A degraded pool fails /health but must not restart the head or unroute it.
        assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "serve"}
        for probe in ("livenessProbe", "startupProbe"):
            assert head[probe]["grpc"] == {"port": serve["grpc_port"], "service": READY_SERVICE}


def test_monitoring_objects_target_the_service():
    name = "multi-gpu"
    (service,) = objects_of(name, "Service")
    (monitor,) = objects_of(name, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [deploy.RELEASE_NAMESPACE]
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    (dashboard_map,) = objects_of(name, "ConfigMap")
    assert dashboard_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = dashboard_map["data"].values()
    dashboard = json.loads(text)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for metric in DASHBOARD_METRICS:
        assert any(metric in e for e in exprs), f"no dashboard panel charts {metric}"
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for topic in ("TTFT", "ITL", "Queue depth", "KV cache block usage", "KV transfer"):
        assert topic in titles
    # Without monitoring enabled (the default) neither object renders.
    assert not objects_of("default", "ServiceMonitor") and not objects_of("default", "ConfigMap")


def test_dashboard_metrics_exist_in_the_app():
    from splitserve.cluster.control.pool_metrics import PoolMetrics
    from splitserve.cluster.frontend.metrics import Metrics

    exposed = set()
    # /metrics renders both: every ingress's series and the controller's pool series.
    families = [*Metrics("dashboard-test").registry.collect(), *PoolMetrics("dashboard-test").registry.collect()]
    for family in families:
        exposed.add(family.name)
        exposed.update(sample.name for sample in family.samples)
        if family.type == "counter":
            exposed.add(family.name + "_total")
    dashboard = json.loads((deploy.CHART_DIR / "dashboards" / "splitserve.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    used = set(re.findall(r"splitserve_[a-z0-9_]+", exprs))
    histograms = {m.removesuffix("_bucket") for m in used if m.endswith("_bucket")}
    assert used - exposed - {h + "_bucket" for h in histograms} == set()
    assert histograms <= exposed
