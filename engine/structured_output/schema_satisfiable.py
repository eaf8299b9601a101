"""Whether any finite JSON value satisfies a schema, as far as its structure decides: a
`$ref` cycle with no way out (`{"$ref": "#"}`, an object whose required property refers
back to the object, tools whose parameters refer to themselves) has none. llguidance
compiles those and then produces nothing, or an unfinished prefix ("[" with "Too many
items"), so they are refused up front.

A least fixed point over the schema's subschemas: a subschema is satisfiable when its
`$ref` target, all of `allOf`, one of `anyOf` / `oneOf`, its required properties and its
required array items are. Keywords it does not model count as satisfiable (llguidance
judges the rest); it only refuses what it can prove empty.
"""

from __future__ import annotations

from typing import Any

_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SINGLE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
MAX_PASSES = 200  # undecided after this many: assume satisfiable (never refuse on a guess)


def unsatisfiable_reason(schema: Any) -> str | None:
    """None, or why no value satisfies schema."""
    nodes = _subschemas(schema)
    ok = {pointer: False for pointer in nodes}
    for _ in range(MAX_PASSES):
        changed = False
        for pointer, node in nodes.items():
            if not ok[pointer] and _satisfiable(pointer, node, ok):
                ok[pointer] = changed = True
        if ok[""]:
            return None
        if not changed:
            return _describe(schema)
    return None


def _describe(schema: Any) -> str:
    if isinstance(schema, dict) and "$ref" in schema:
        return f"it refers to itself ($ref {schema['$ref']!r}) with no way for the recursion to end"
    return "no JSON value matches it (a $ref cycle with no way out, or a required part that matches nothing)"


def _subschemas(schema: Any) -> dict[str, Any]:
    """Every subschema by its JSON pointer ("" is the root), walked iteratively."""
    nodes: dict[str, Any] = {}
    stack = [("", schema)]
    while stack:
        pointer, node = stack.pop()
        nodes[pointer] = node
        if not isinstance(node, dict):
            continue
        for key in _LISTS:
            if isinstance(node.get(key), list):
                stack.extend((f"{pointer}/{key}/{i}", child) for i, child in enumerate(node[key]))
        for key in _MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((f"{pointer}/{key}/{_escape(name)}", child) for name, child in node[key].items())
        for key in _SINGLE:
            if key in node:
                child = node[key]
                if isinstance(child, list) and key == "items":  # draft-4 tuple form
                    stack.extend((f"{pointer}/items/{i}", c) for i, c in enumerate(child))
                else:
                    stack.append((f"{pointer}/{key}", child))
    return nodes


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _known(ok: dict[str, bool], pointer: str) -> bool:
    return ok.get(pointer, True)  # not a subschema we walked: not ours to judge


def _satisfiable(here: str, node: Any, ok: dict[str, bool]) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not _known(ok, ref[1:]):
        return False
    if isinstance(node.get("allOf"), list):
        if not all(_known(ok, f"{here}/allOf/{i}") for i in range(len(node["allOf"]))):
            return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key]:
            if not any(_known(ok, f"{here}/{key}/{i}") for i in range(len(node[key]))):
                return False
    if _only_type(node, "object"):
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for name in node.get("required") or []:
            if not isinstance(name, str):
                continue
            if name in properties:
                if not _known(ok, f"{here}/properties/{_escape(name)}"):
                    return False
            elif node.get("additionalProperties") is False:
                return False
            elif "additionalProperties" in node and not _known(ok, f"{here}/additionalProperties"):
                return False
    if _only_type(node, "array"):
        needed = node.get("minItems") if isinstance(node.get("minItems"), int) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        for i in range(min(needed, len(prefix))):
            if not _known(ok, f"{here}/prefixItems/{i}"):
                return False
        if needed > len(prefix) and "items" in node and not isinstance(node["items"], list):
            if not _known(ok, f"{here}/items"):
                return False
    return True


def _only_type(node: dict, name: str) -> bool:
    kind = node.get("type")
    return kind == name or kind == [name]
