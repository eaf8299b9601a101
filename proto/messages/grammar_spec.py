"""What a constrained request asks its output to match: a JSON schema, any JSON object, a
regex, one of a list of choices, or a Lark / GBNF grammar. A small frozen msgspec Struct that
travels inside SamplingParams, checked on construction and again when decoded. Compiling it is
the grammar compiler's job (engine/structured_output/grammar_compiler.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from splitserve.proto.messages.invalid_request import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a grammar larger than the HTTP body limit is an error anyway
MAX_CHOICES = 4096
# Python's own JSON parser recurses; beyond this a schema cannot even be read safely.
HARD_MAX_JSON_DEPTH = 500

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class GrammarSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str
    # json_schema: the schema as JSON text; regex: the pattern; grammar: Lark or GBNF text;
    # choice: a JSON list of the choice strings; json_object: unused.
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise InvalidRequestError(f"the {self.kind} constraint must be a string")
        if len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the {self.kind} constraint is longer than {MAX_SPEC_CHARS} characters")
        if self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError(f"the {self.kind} constraint is empty")
        if self.kind == "json_schema":
            schema = _loads(self.value, "the JSON schema")
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("a JSON schema must be an object (or true / false)")
        if self.kind == "choice":
            self.choices()  # checks the list

    # ---- constructors --------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        if isinstance(schema, str):
            schema = _loads(schema, "the JSON schema")
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be an object (or true / false)")
        # Key order kept: properties are generated in the order the schema lists them.
        try:
            text = json.dumps(schema, separators=(",", ":"))
        except (RecursionError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"the JSON schema cannot be encoded: {exc}") from None
        return cls("json_schema", text)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        if not isinstance(choices, (list, tuple)):
            raise InvalidRequestError("choice must be a list of strings")
        return cls("choice", json.dumps(list(choices), separators=(",", ":")))

    # ---- accessors -----------------------------------------------------------------------
    def choices(self) -> list[str]:
        values = _loads(self.value, "the choice list")
        if not isinstance(values, list) or not values or len(values) > MAX_CHOICES:
            raise InvalidRequestError(f"choice must be a list of 1 to {MAX_CHOICES} strings")
        if not all(isinstance(v, str) and v for v in values):
            raise InvalidRequestError("every choice must be a non-empty string")
        return values


def _loads(text: str, what: str) -> Any:
    # json.loads recurses: a 10,000-deep '{"a":{"a":...' would be a RecursionError (a 500).
    # Count the nesting first, without recursion; GrammarConfig.max_schema_depth is tighter.
    if isinstance(text, str) and json_depth(text, HARD_MAX_JSON_DEPTH) > HARD_MAX_JSON_DEPTH:
        raise InvalidRequestError(
            f"{what} nests more than {HARD_MAX_JSON_DEPTH} levels deep; the limit is {HARD_MAX_JSON_DEPTH}"
        )
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"{what} is not valid JSON: {exc}") from None


def json_depth(text: str, stop_above: int | None = None) -> int:
    """Nesting depth of JSON text, without parsing it (no recursion). Stops counting once
    it passes stop_above."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    return deepest
        else:
            depth -= 1
    return deepest
