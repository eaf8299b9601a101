"""Deployment on Kubernetes: the Helm chart in helm/splitserve/ (a KubeRay RayService) renders
valid objects -- lint, Kubernetes schemas, the KubeRay CRDs, the Serve config it embeds.

Everything runs offline: Helm's Go SDK through helm-python-sdk (no helm binary), the KubeRay
CRDs from $SPLITSERVE_CRD_DIR (default ../shared/crds; the CRD checks skip without them, or fail
under SPLITSERVE_REQUIRE_CRDS=1) and kubernetes-validate. Each test runs for the chart's default values
and for every helm/splitserve/ci/*.yaml. What the objects wire up: test_deploy_helm_objects.py;
the values' schema and checks: test_deploy_helm_values.py.
"""

from __future__ import annotations

import re

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from splitserve.cluster.config import ServeConfig
from tests.helpers import deploy
from tests.helpers.deploy import all_objects_of, crd_validator, merged_values_of, ray_service_of, values_for

POOLS = deploy.POOLS
VALUE_SETS = deploy.value_set_names()
KUBE_VERSION = kubernetes_validate.latest_version()


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
    app = deploy.serve_app_of(name)
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

    assert deploy.serve_app_of(name)["import_path"] == app_module.APP_IMPORT_PATH
