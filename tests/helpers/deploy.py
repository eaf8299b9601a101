"""Helpers of tests/test_deploy*.py: paths, offline Helm rendering, strict CRD schemas.

Run as a script to regenerate the ServeConfig part of the chart's values.schema.json after
cluster/config.py changes (test_deploy_helm fails until you do):

    .venv/bin/python tests/helpers/deploy.py
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "cluster" / "deploy"
CHART_DIR = REPO_ROOT / "helm" / "splitserve"
VALUES_SCHEMA_PATH = CHART_DIR / "values.schema.json"
# The KubeRay CRDs (ray.io_rayservices.yaml, ray.io_rayclusters.yaml, ~1 MB of YAML from KubeRay's
# operator config) are not vendored: they come from $SPLITSERVE_CRD_DIR, by default ../shared/crds
# beside the repository. Without them the CRD checks skip, naming the missing file; CI sets
# SPLITSERVE_REQUIRE_CRDS=1 (.ci/run), which makes that a failure. See helm/splitserve/README.md.
CRD_DIR = Path(os.environ.get("SPLITSERVE_CRD_DIR") or REPO_ROOT.parent / "shared" / "crds")
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
RELEASE_NAME = "demo"
RELEASE_NAMESPACE = "llm"
POOLS = ("prefill", "decode")


def serve_schema_definitions() -> dict[str, Any]:
    """JSON-schema definitions of ServeConfig and its parts, generated from the pydantic
    models, with refs under `#/definitions/` (understood by every Helm schema validator)."""
    from splitserve.cluster.config import ServeConfig

    schema = ServeConfig.model_json_schema()
    definitions = schema.pop("$defs", {})
    definitions["ServeConfig"] = schema
    text = json.dumps(definitions, sort_keys=True).replace('"#/$defs/', '"#/definitions/')
    return json.loads(text)


def write_values_schema() -> None:
    """Replace values.schema.json's `definitions` with the ones generated from ServeConfig."""
    schema = json.loads(VALUES_SCHEMA_PATH.read_text())
    schema["definitions"] = serve_schema_definitions()
    VALUES_SCHEMA_PATH.write_text(json.dumps(schema, indent=2) + "\n")


# The CRDs are ~1 MB of YAML: libyaml's loader reads them ten times faster.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: Path) -> Any:
    with path.open() as f:
        return yaml.load(f, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader


def ci_values_files() -> list[Path]:
    return sorted((CHART_DIR / "ci").glob("*.yaml"))


def render_chart(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Render the chart offline (helm-python-sdk binds Helm's Go SDK; no helm binary)."""
    import helm_python

    with helm_python.Chart.load(CHART_DIR) as chart:
        return chart.render(values=values, name=RELEASE_NAME, namespace=RELEASE_NAMESPACE, is_install=True)


def merged_values(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chart's defaults coalesced with `values`, as an install would see them."""
    import helm_python

    with helm_python.Chart.load(CHART_DIR) as chart:
        return chart.merge_values(values)


def rendered_objects(manifests: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (NOTES.txt and empty templates skipped)."""
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects


def _strict(node: Any) -> None:
    """Forbid fields a schema does not declare, the way the API server prunes them: a typo
    in a rendered manifest then fails validation instead of vanishing silently."""
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)


def crd_path(kind: str) -> Path:
    """The KubeRay CRD file of `kind`; skips the calling test when it is absent, or fails it
    when SPLITSERVE_REQUIRE_CRDS=1 (CI, where a missing CRD must not pass silently)."""
    path = CRD_DIR / CRD_FILES[kind]
    if not path.is_file():
        reason = f"KubeRay CRD {path} not found (set SPLITSERVE_CRD_DIR to a directory holding {CRD_FILES[kind]})"
        if os.environ.get("SPLITSERVE_REQUIRE_CRDS") == "1":
            pytest.fail(f"{reason}; SPLITSERVE_REQUIRE_CRDS=1 requires it", pytrace=False)
        pytest.skip(reason)
    return path


@cache
def _crd_schema(kind: str, version: str) -> str:
    crd = load_yaml(crd_path(kind))
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            schema = copy.deepcopy(served["schema"]["openAPIV3Schema"])
            _strict(schema)
            return json.dumps(schema)
    raise KeyError(f"{kind} CRD has no version {version}")


def crd_schema(kind: str, version: str = "v1") -> dict[str, Any]:
    """The KubeRay CRD's openAPIV3Schema for kind/version, made strict (see _strict)."""
    return json.loads(_crd_schema(kind, version))


def iter_ray_pod_templates(ray_service: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(group name, pod template) of the head group and every worker group."""
    cluster = ray_service["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster["workerGroupSpecs"]:
        yield group["groupName"], group["template"]


def parse_ray_resources(param: str) -> dict[str, float]:
    """Decode a rayStartParams `resources` value: KubeRay wants the JSON object as a quoted,
    escaped string ('"{\\"prefill_gpu\\": 1}"'), i.e. a JSON string holding JSON."""
    inner = json.loads(param)
    if not isinstance(inner, str):
        raise ValueError(f"rayStartParams resources must be a quoted JSON string: {param!r}")
    return json.loads(inner)


def quantity(value: str | int | float) -> float:
    """A Kubernetes CPU quantity ("6", "500m", 2) in cores."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def model_field_tree(model_cls) -> dict[str, Any]:
    """{field: subtree or None} of a pydantic model, descending into nested models."""
    from pydantic import BaseModel

    tree = {}
    for field_name, field in model_cls.model_fields.items():
        annotation = field.annotation
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        tree[field_name] = model_field_tree(annotation) if is_model else None
    return tree


def key_tree(values: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """The keys of `values`, descending where `like` (a model_field_tree) has a subtree."""
    return {k: (key_tree(values[k], like[k]) if like.get(k) is not None else None) for k in values}


# Value sets: "default" (the chart's values.yaml) and the stem of every ci/*.yaml. Renders
# are cached per set; accessors hand out deep copies so tests cannot disturb each other.


def value_set_names() -> list[str]:
    return ["default"] + [path.stem for path in ci_values_files()]


def values_for(name: str) -> dict[str, Any] | None:
    if name == "default":
        return None
    return load_yaml(CHART_DIR / "ci" / f"{name}.yaml")


@cache
def _rendered_set(name: str) -> str:
    return json.dumps(rendered_objects(render_chart(values_for(name))))


def objects_of(name: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in json.loads(_rendered_set(name)) if o["kind"] == kind]


def all_objects_of(name: str) -> list[dict[str, Any]]:
    return json.loads(_rendered_set(name))


def ray_service_of(name: str) -> dict[str, Any]:
    (ray_service,) = objects_of(name, "RayService")
    return ray_service


@cache
def _merged_set(name: str) -> str:
    return json.dumps(merged_values(values_for(name)))


def merged_values_of(name: str) -> dict[str, Any]:
    return json.loads(_merged_set(name))


def serve_app_of(name: str) -> dict[str, Any]:
    """The one Serve application of the RayService's serveConfigV2."""
    serve_config = yaml.safe_load(ray_service_of(name)["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return app


def pods_for(replicas: int, per_pod: int) -> int:
    return math.ceil(replicas / per_pod)


@cache
def crd_validator(kind: str):
    """A cached jsonschema validator of the strict KubeRay CRD schema of `kind`."""
    import jsonschema

    return jsonschema.Draft7Validator(crd_schema(kind))


if __name__ == "__main__":
    write_values_schema()
    print(f"wrote {VALUES_SCHEMA_PATH.relative_to(REPO_ROOT)}")
