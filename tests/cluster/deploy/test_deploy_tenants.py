"""The chart's tenant pieces: the example alert rules pass `promtool check rules` (skipped
without promtool) and render into a PrometheusRule; the tenants' keys Secret is mounted
read-only in the head and every worker pod, where a tenant's api_keys_file points."""

from __future__ import annotations

import shutil
import subprocess

import pytest

pytest.importorskip("helm_python")

from tests.helpers import deploy  # noqa: E402
from tests.helpers.deploy import objects_of, ray_service_of  # noqa: E402

RULES = deploy.CHART_DIR / "rules" / "tenants.yaml"
WITH_TENANTS = "multi-gpu"  # the ci value set that turns the rule and the keys Secret on


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)
def test_promtool_accepts_the_tenant_alert_rules():
    result = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_name_the_tenant_metrics_and_render_into_a_prometheus_rule():
    rules = deploy.load_yaml(RULES)
    exprs = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    assert "splitserve_tenant_budget_remaining" in exprs and "splitserve_tenant_tokens_total" in exprs
    (rule,) = objects_of(WITH_TENANTS, "PrometheusRule")
    assert rule["spec"] == rules
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"


def test_tenant_keys_secret_is_mounted_in_every_ray_pod():
    spec = ray_service_of(WITH_TENANTS)["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tenant-keys"]["secret"]["secretName"] == "splitserve-tenant-keys"
        for container in pod["containers"][:1]:
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["tenant-keys"] == {
                "name": "tenant-keys",
                "mountPath": "/etc/splitserve/tenant-keys",
                "readOnly": True,
            }
