"""Deployment on Kubernetes: the Helm chart in helm/splitserve/ (a KubeRay RayService).

Everything runs offline: Helm's Go SDK through helm-python-sdk (no helm binary), the KubeRay
CRDs from $SPLITSERVE_CRD_DIR (default ../shared/crds; the CRD checks skip without them, or fail
under SPLITSERVE_REQUIRE_CRDS=1) and kubernetes-validate. Each test runs for the chart's default values
and for every helm/splitserve/ci/*.yaml.
"""

from __future__ import annotations

import json
import math
import re

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from splitserve.cluster.config import ServeConfig  # noqa: E402
from splitserve.cluster.frontend.grpc.health import READY_SERVICE  # noqa: E402
from splitserve.cluster.routing.router_config import ROUTER_POLICIES  # noqa: E402
from tests.helpers import deploy  # noqa: E402
from tests.helpers.deploy import all_objects_of, crd_validator, merged_values_of, objects_of, ray_service_of, values_for  # noqa: E402

POOLS = deploy.POOLS
VALUE_SETS = deploy.value_set_names()
KUBE_VERSION = kubernetes_validate.latest_version()
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


def _serve_app(name: str) -> dict:
    serve_config = yaml.safe_load(ray_service_of(name)["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return app


def _pods_for(replicas: int, per_pod: int) -> int:
    return math.ceil(replicas / per_pod)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(name):
    report = helm_python.lint(deploy.CHART_DIR, values_for(name), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_validate(name):
    """Every object of a core kind, and every Ray pod template, against the Kubernetes schemas
    (needs no CRDs, so it runs on a fresh clone too)."""
    objects = all_objects_of(name)
    kinds = sorted(o["kind"] for o in objects)
    assert {"RayService", "Service"} <= set(kinds)
    for obj in objects:
        if obj["apiVersion"] == "ray.io/v1":
            continue  # test_ray_objects_validate_against_the_kuberay_crds
        if obj["kind"] in ("ServiceMonitor", "PrometheusRule"):
            # checked further below, and in test_deploy_tenants.py
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    ray_service = ray_service_of(name)
    # KubeRay wants a DNS-1035 label and derives longer names (Services, RayClusters) from it.
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", ray_service["metadata"]["name"])
    for group, template in deploy.iter_ray_pod_templates(ray_service):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": template},
            KUBE_VERSION,
            strict=True,
        )


@pytest.mark.parametrize("name", VALUE_SETS)
def test_ray_objects_validate_against_the_kuberay_crds(name):
    """ray.io objects against the strict KubeRay CRD schemas (skips without the CRDs, see
    tests/helpers/deploy.py)."""
    ray_objects = [o for o in all_objects_of(name) if o["apiVersion"] == "ray.io/v1"]
    assert ray_objects
    for obj in ray_objects:
        crd_validator(obj["kind"]).validate(obj)
    # The embedded cluster is a valid RayCluster spec too.
    crd_validator("RayCluster").validate(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": {"name": "check"},
            "spec": ray_service_of(name)["spec"]["rayClusterConfig"],
        }
    )


def test_missing_crds_skip_with_the_file_named_or_fail_when_required(monkeypatch, tmp_path):
    monkeypatch.setattr(deploy, "CRD_DIR", tmp_path)
    monkeypatch.delenv("SPLITSERVE_REQUIRE_CRDS", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"ray\.io_rayservices\.yaml not found.*SPLITSERVE_CRD_DIR"):
        deploy.crd_path("RayService")
    monkeypatch.setenv("SPLITSERVE_REQUIRE_CRDS", "1")
    with pytest.raises(pytest.fail.Exception, match=r"ray\.io_rayclusters\.yaml not found.*REQUIRE_CRDS=1"):
        deploy.crd_path("RayCluster")
    (tmp_path / "ray.io_rayclusters.yaml").write_text("kind: CustomResourceDefinition\n")
    assert deploy.crd_path("RayCluster") == tmp_path / "ray.io_rayclusters.yaml"


def test_crd_validation_catches_typos():
    bad = ray_service_of("default")
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParam"] = {}
    with pytest.raises(jsonschema.ValidationError):
        crd_validator("RayService").validate(bad)
    bad = ray_service_of("default")
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        crd_validator("RayService").validate(bad)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_serve_config_v2_args_are_the_serve_values(name):
    serve_config = yaml.safe_load(ray_service_of(name)["spec"]["serveConfigV2"])
    app = _serve_app(name)
    cfg = ServeConfig.model_validate(app["args"])
    assert cfg == ServeConfig.model_validate(merged_values_of(name)["serve"])
    assert app["route_prefix"] == "/"
    assert serve_config["http_options"] == {
        "host": "0.0.0.0",
        "port": cfg.http_port,
        "keep_alive_timeout_s": cfg.http_keep_alive_timeout_s,
    }


def test_a_models_list_renders_into_the_apps_args_with_per_model_resources():
    models = [
        {
            "model": "/models/small",
            "served_model_name": "small",
            "decode": {"resources": {"resources": {"small_gpu": 1}}},
        },
        {"model": "/models/large", "served_model_name": "large", "quantization": "fp8"},
    ]
    manifests = deploy.render_chart({"serve": {"models": models}})
    ray_service = next(o for o in deploy.rendered_objects(manifests) if o["kind"] == "RayService")
    (app,) = yaml.safe_load(ray_service["spec"]["serveConfigV2"])["applications"]
    cfg = ServeConfig.model_validate(app["args"])
    deployments = dict(cfg.model_deployments())
    assert list(deployments) == ["small", "large"]
    assert deployments["small"].decode.resources.resources == {"small_gpu": 1}
    assert deployments["large"].quantization == "fp8"
    assert (
        deployments["large"].decode.resources
        == ServeConfig.model_validate(deploy.merged_values()["serve"]).decode.resources
    )


@pytest.mark.parametrize("name", VALUE_SETS)
def test_serve_config_v2_imports_the_app(name):
    from splitserve.cluster import app as app_module

    assert _serve_app(name)["import_path"] == app_module.APP_IMPORT_PATH


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
    off = deploy.render_chart({"frontDoor": {"haproxy": False}, "head": {"extraEnv": [{"name": "X", "value": "1"}]}})
    head = next(o for o in deploy.rendered_objects(off) if o["kind"] == "RayService")
    head = head["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["env"] == [{"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "0"}, {"name": "X", "value": "1"}]


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
        custom = pool_cfg.resources.resources
        params = group["rayStartParams"]
        if custom:
            advertised = deploy.parse_ray_resources(params["resources"])
            assert advertised == {k: v * per_pod for k, v in custom.items()}
        else:
            assert "resources" not in params
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"].get("limits", {})
        num_gpus = math.ceil(pool_cfg.resources.num_gpus * per_pod)
        assert int(limits.get("nvidia.com/gpu", 0)) == num_gpus
        assert deploy.quantity(limits["cpu"]) >= pool_cfg.resources.num_cpus * per_pod
        scaling = pool_cfg.autoscaling
        low, high = (
            (scaling.min_replicas, scaling.max_replicas) if scaling.enabled else (pool_cfg.replicas, pool_cfg.replicas)
        )
        if autoscaler_on:
            expected = (_pods_for(low, per_pod), _pods_for(high, per_pod))
        else:
            expected = (_pods_for(high, per_pod),) * 2
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


BAD_VALUES = {
    "negative replicas": {"serve": {"prefill": {"replicas": -1}}},
    "unknown router policy": {"serve": {"router": {"policy": "fastest"}}},
    "zero max replicas": {"serve": {"decode": {"autoscaling": {"max_replicas": 0}}}},
    "unknown serve field": {"serve": {"num_gpus": 1}},
    "unknown model source": {"model": {"source": "s3"}},
    "zero replicas per pod": {"workerGroups": {"decode": {"replicasPerPod": 0}}},
    "unknown upscaling mode": {"rayAutoscaler": {"upscalingMode": "Fast"}},
    "string port": {"serve": {"http_port": "8000"}},
    "unknown front door field": {"frontDoor": {"proxy": "nginx"}},
    "zero haproxy threads": {"frontDoor": {"haproxyThreads": 0}},
    "unknown speculative method": {"serve": {"speculative": {"method": "medusa"}}},
    "zero speculative tokens": {"serve": {"speculative": {"num_speculative_tokens": 0}}},
    "unknown model entry field": {"serve": {"models": [{"model": "/m/a", "num_gpus": 1}]}},
}


@pytest.mark.parametrize("bad", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_values_schema_rejects_bad_values(bad):
    with pytest.raises(helm_python.HelmValuesError):
        deploy.render_chart(bad)


def test_lint_reports_bad_values():
    report = helm_python.lint(deploy.CHART_DIR, BAD_VALUES["unknown router policy"], strict=True)
    assert any("policy" in e for e in report["errors"])


CROSS_FIELD_ERRORS = {
    "mounted model without a path": ({"serve": {"model": None}}, "serve.model must be set"),
    "relative model path": ({"serve": {"model": "models/x"}}, "absolute path"),
    "relative state dir": ({"serve": {"state_dir": "state"}}, "serve.state_dir must be an absolute path"),
    "no state dir nor url": ({"serve": {"state_dir": None}}, "serve.state_dir must be an absolute path"),
    "min above max replicas": (
        {"serve": {"prefill": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}}},
        "min_replicas",
    ),
}


@pytest.mark.parametrize("bad, message", CROSS_FIELD_ERRORS.values(), ids=CROSS_FIELD_ERRORS.keys())
def test_templates_reject_inconsistent_values(bad, message):
    with pytest.raises(helm_python.HelmError, match=message):
        deploy.render_chart(bad)


def test_router_policy_enum_matches_serve_config():
    schema = json.loads(deploy.VALUES_SCHEMA_PATH.read_text())
    policy = schema["definitions"]["RouterConfig"]["properties"]["policy"]
    assert sorted(policy["enum"]) == sorted(ROUTER_POLICIES)


def test_values_schema_is_generated_from_serve_config():
    schema = json.loads(deploy.VALUES_SCHEMA_PATH.read_text())
    assert schema["definitions"] == deploy.serve_schema_definitions(), (
        "values.schema.json is stale: run .venv/bin/python tests/helpers/deploy.py"
    )
    assert schema["properties"]["serve"]["$ref"] == "#/definitions/ServeConfig"


def test_chart_values_list_every_serve_config_field():
    """values.yaml's serve block spells out all of ServeConfig, so nothing is hidden."""
    raw = deploy.load_yaml(deploy.CHART_DIR / "values.yaml")["serve"]
    fields = deploy.model_field_tree(ServeConfig)
    assert deploy.key_tree(raw, fields) == fields
    ServeConfig.model_validate(raw)
