"""The structured-output fields of an OpenAI request, turned into one GrammarSpec.

Accepted (at most one per request):
- OpenAI `response_format`: {"type": "text"}, {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}};
- vLLM's `structured_outputs`: {"json": schema, "regex": ..., "choice": [...],
  "grammar": ..., "json_object": true} with exactly one key set;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- a tool call forced or allowed by `tools` + `tool_choice` (openai/tools.py).
A grammar is Lark, or GBNF (`root ::= ...`) as vLLM's xgrammar backend takes it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.invalid_request import InvalidRequestError


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute, hence the alias.
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` request field."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _response_format_spec(fmt: ResponseFormat) -> GrammarSpec | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise _error('response_format {"type": "json_schema"} needs json_schema.schema', "response_format")
    return GrammarSpec.json_schema(fmt.json_schema.schema_)


def _structured_outputs_spec(so: StructuredOutputs) -> GrammarSpec | None:
    given = {
        "json": so.json_,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object or None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise _error(f"structured_outputs takes one constraint, got {sorted(given)}", "structured_outputs")
    if not given:
        return None
    return _spec(*next(iter(given.items())))


def _spec(kind: str, value: Any) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec.json_schema(value)
    if kind == "choice":
        return GrammarSpec.choice(value)
    if kind == "json_object":
        return GrammarSpec("json_object")
    return GrammarSpec(kind, value)


def grammar_spec_for(request, tool_grammar: GrammarSpec | None = None) -> GrammarSpec | None:
    """The one constraint a request asks for (None: free text). Raises RequestParamError
    when it asks for more than one or a field is malformed."""
    found = _constraints(request, tool_grammar)
    return next(iter(found.values()), None)


def constraint_field(request, tool_grammar: GrammarSpec | None = None) -> str | None:
    """The request field the constraint came from (error messages name it)."""
    return next(iter(_constraints(request, tool_grammar)), None)


def _constraints(request, tool_grammar: GrammarSpec | None) -> dict[str, GrammarSpec]:
    found: dict[str, GrammarSpec] = {}
    fmt = getattr(request, "response_format", None)
    if fmt is not None:
        spec = _named(_response_format_spec, fmt, "response_format")
        if spec is not None:
            found["response_format"] = spec
    if request.structured_outputs is not None:
        spec = _named(_structured_outputs_spec, request.structured_outputs, "structured_outputs")
        if spec is not None:
            found["structured_outputs"] = spec
    for field, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, field)
        if value is not None:
            found[field] = _named(lambda v, k=kind: _spec(k, v), value, field)
    if tool_grammar is not None:
        found["tool_choice"] = tool_grammar
    if len(found) > 1:
        raise _error(f"give one output constraint, not several: {', '.join(sorted(found))}", sorted(found)[-1])
    return found


def _named(build, value, field: str):
    """build(value), its refusal naming the request field (a 10,000-deep schema, a bad list)."""
    from splitserve.cluster.frontend.openai.protocol import RequestParamError

    try:
        return build(value)
    except RequestParamError:
        raise
    except InvalidRequestError as exc:
        raise _error(f"{field}: {exc}", field) from None


def _error(message: str, param: str):
    from splitserve.cluster.frontend.openai.protocol import RequestParamError

    return RequestParamError(message, param)
