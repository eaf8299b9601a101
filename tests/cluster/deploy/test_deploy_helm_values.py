"""The Helm chart's values: the schema (generated from ServeConfig) rejects bad values, the
templates reject inconsistent ones, and the chart lists every ServeConfig field (see
test_deploy_helm.py)."""

from __future__ import annotations

import json

import helm_python
import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.routing.router_config import ROUTER_POLICIES
from tests.helpers import deploy

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
    "zero proxy check timeout": {"frontDoor": {"proxyCheckTimeoutS": 0}},
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
    "the replica's own listener": ({"serve": {"http_listener": "ingress"}}, "HAProxy"),
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
