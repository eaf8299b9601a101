"""Reads tenants from YAML (the tenants file) with errors that name the file and the line.

The file is a list of tenants or a mapping {tenants: [...]}. A YAML syntax error names its
line; a validation error (a negative limit, an unknown field, a tenant without keys) names the
line of the offending value, found by walking the composed YAML node tree along the error's
location. Keys never appear in a message: only field names and lines.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from splitserve.cluster.tenants.tenant_config import TenantConfig, check_unique_names

_TENANTS = TypeAdapter(list[TenantConfig])


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message names the file and the line."""


def load_tenants_file(path: str | os.PathLike) -> list[TenantConfig]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TenantsFileError(f"{path}: cannot read the tenants file: {exc.strerror or exc}") from None
    return parse_tenants_yaml(text, str(path))


def parse_tenants_yaml(text: str, source: str = "<tenants>") -> list[TenantConfig]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "somewhere"
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise TenantsFileError(f"{source}: {where}: {problem}") from None
    items_node = root
    if isinstance(data, dict):
        if set(data) != {"tenants"}:
            raise TenantsFileError(f"{source}: line 1: expected a list of tenants or a mapping with only 'tenants'")
        data = data["tenants"]
        items_node = _child(root, "tenants")
    if data is None:
        return []
    if not isinstance(data, list):
        line = items_node.start_mark.line + 1 if items_node is not None else 1
        raise TenantsFileError(f"{source}: line {line}: tenants must be a list, got {type(data).__name__}")
    try:
        return check_unique_names(_TENANTS.validate_python(data))
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = error["loc"]
        node = items_node
        for part in loc:
            child = _child(node, part)
            if child is None:
                break
            node = child
        line = node.start_mark.line + 1 if node is not None else 1
        where = f"tenants[{loc[0]}].{'.'.join(str(p) for p in loc[1:]) or 'tenant'}" if loc else "tenants"
        raise TenantsFileError(f"{source}: line {line}: {where}: {error['msg']}") from None
    except ValueError as exc:
        raise TenantsFileError(f"{source}: {exc}") from None


def _child(node, part):
    """The YAML node under node at part (a list index or a mapping key), or None."""
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part]
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == part:
                return value
    return None
