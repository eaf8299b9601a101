"""/openapi.json states what validation enforces, so clients generated from it and fuzzers in
positive mode (schemathesis) send nothing the server then refuses: the served models (every
name in the ModelCatalog) as the only `model` values, token ids and top_k bounded by the
served vocabulary, non-empty constraint strings and lists, best_of 1, and the relations JSON Schema can express (top_logprobs needs
logprobs, tool_choice needs tools, prompt_logprobs not with stream).

Where the documented schema is narrower than what is accepted (a schema given as a JSON string,
best_of equal to n, max_tokens 0 with echo), the description says so. Refusals that depend on
state or compare two fields (prompt + max_tokens past the model's length, min_tokens past
max_tokens, prompts x n past 128, duplicate tool names, two output constraints at once) are
not stated: JSON Schema cannot compare fields, and schemathesis cannot generate from `not`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from splitserve.cluster.frontend.openai.unsupported import UNSUPPORTED_PARAMETERS
from splitserve.proto.messages.grammar_spec import MAX_CHOICES

GENERATION = ("CompletionRequest", "ChatCompletionRequest")
MODEL_FIELDS = (*GENERATION, "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest")
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
JSON_SCHEMA_DOC = {"type": "object", "description": "a JSON schema (a JSON string holding one is accepted too)"}
NON_EMPTY_STRING = {"type": "string", "minLength": 1}
CHOICES = {"type": "array", "items": NON_EMPTY_STRING, "minItems": 1, "maxItems": MAX_CHOICES}


def state_bounds_in_openapi(
    app: FastAPI, model_names: Callable[[], list[str]], vocab_size: Callable[[], int | None]
) -> None:
    """model_names, vocab_size: read when /openapi.json is first built (names registered after
    the app was made are listed too)."""
    base_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            bound_schema(base_openapi(), model_names(), vocab_size())
        return app.openapi_schema

    app.openapi = openapi


def bound_schema(schema: dict, model_names: list[str], vocab_size: int | None) -> None:
    components = schema["components"]["schemas"]
    _walk(components, vocab_size)
    for name in MODEL_FIELDS:
        if name in components:
            components[name]["properties"]["model"] = _nullable_like(
                components[name]["properties"]["model"], {"type": "string", "enum": list(model_names)}
            )
    for name in GENERATION:
        props = components[name]["properties"]
        props["guided_json"] = _optional(JSON_SCHEMA_DOC)
        props["guided_regex"] = _optional(NON_EMPTY_STRING)
        props["guided_grammar"] = _optional({**NON_EMPTY_STRING, "description": "Lark or GBNF"})
        props["guided_choice"] = _optional(CHOICES)
        if "logit_bias" in props and vocab_size:
            props["logit_bias"] = _optional(
                {
                    "type": "object",
                    "propertyNames": {"pattern": _ids_below(vocab_size)},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                    "maxProperties": 300,
                    "description": "token id (as a string) -> bias in [-100, 100]; -100 bans the token",
                }
            )
        # One output constraint per request is stated in the descriptions only: schemathesis
        # cannot generate from `not`, and `dependencies` across these fields defeats it too.
        components[name]["dependencies"] = {}
        components[name]["dependencies"]["prompt_logprobs"] = {"properties": {"stream": {"const": False}}}
        if "priority" in props:  # SamplingParams refuses what does not fit 32 bits
            int32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
            props["priority"] = {**props["priority"], "anyOf": [int32, {"type": "null"}]}
        # Unimplemented parameters ride in the open extra fields; stated here with the only
        # values accepted (a client generating arbitrary extras must not pick these names).
        for param, (neutral, reason) in UNSUPPORTED_PARAMETERS.items():
            props.setdefault(param, {"enum": list(neutral), "description": f"not supported: {reason}"})
    completion = components["CompletionRequest"]["properties"]
    completion["best_of"] = _optional(
        {"type": "integer", "enum": [1], "description": "1 (or equal to n): every generated choice is returned"}
    )
    completion["max_tokens"] = _optional(
        {"type": "integer", "minimum": 1, "description": "also 0 with echo: the prompt alone, as vLLM's"}
    )
    chat = components["ChatCompletionRequest"]
    chat["properties"]["tools"] = _optional({**_deref(chat["properties"]["tools"]), "minItems": 1})
    chat["dependencies"].update(
        {
            "top_logprobs": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            "tool_choice": {"required": ["tools"], "properties": {"tools": _deref(chat["properties"]["tools"])}},
        }
    )
    # {"type": "json_schema"} needs json_schema.schema; the other types take nothing else.
    json_schema_format = components["JsonSchemaFormat"]
    json_schema_format["properties"]["schema"] = JSON_SCHEMA_DOC
    json_schema_format["required"] = ["schema"]
    components["ResponseFormat"] = {
        "title": "ResponseFormat",
        "anyOf": [
            {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {"$ref": "#/components/schemas/JsonSchemaFormat"},
                },
                "required": ["type", "json_schema"],
            },
        ],
    }
    so = components["StructuredOutputs"]["properties"]
    so["json"] = _optional(JSON_SCHEMA_DOC)
    so["regex"] = _optional(NON_EMPTY_STRING)
    so["grammar"] = _optional(NON_EMPTY_STRING)
    so["choice"] = _optional(CHOICES)
    components["StructuredOutputs"]["maxProperties"] = 1  # one constraint


def _walk(node: Any, vocab_size: int | None) -> None:
    """Turn the protocol's markers into bounds (or drop them when the vocabulary is unknown)."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.pop("x-token-id", False) and vocab_size:
                item["maximum"] = vocab_size - 1
            if item.pop("x-vocab-bound", False) and vocab_size:
                item["maximum"] = vocab_size
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _optional(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _nullable_like(original: dict, schema: dict) -> dict:
    nullable = any(branch.get("type") == "null" for branch in original.get("anyOf", []))
    return _optional(schema) if nullable else schema


def _deref(optional: dict) -> dict:
    """The non-null branch of an Optional field's schema."""
    return next(b for b in optional.get("anyOf", [optional]) if b.get("type") != "null")


def _ids_below(vocab_size: int) -> str:
    """A regex of decimal ids below vocab_size: every number with fewer digits than its
    largest id, plus those of equal length not above it (digit by digit)."""
    top = str(vocab_size - 1)
    alternatives = ["0"] if len(top) == 1 else ["0", f"[1-9][0-9]{{0,{len(top) - 2}}}"]
    if len(top) == 1:
        return f"^[0-{top}]$"
    for i, digit in enumerate(top):
        low = "1" if i == 0 else "0"
        if int(digit) > int(low):
            rest = len(top) - i - 1
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"
