"""Static bounds on a constraint, checked in Python before any grammar reaches llguidance
(whose native code can crash or run away on hostile input): GBNF / Lark rule count and
rule-reference depth, JSON nesting depth, regex repetition bounds, and JSON schemas that no
value can satisfy ($ref cycles without an exit, engine/structured_output/schema_satisfiable.py).

Every refusal is a GrammarLimitError naming the limit (its GrammarConfig field); the frontend
prefixes the request field. Nothing here recurses deeper than the configured limits.
"""

from __future__ import annotations

import json
import re
from typing import Any

from splitserve.engine.structured_output.grammar_config import GrammarConfig
from splitserve.engine.structured_output.schema_satisfiable import unsatisfiable_reason
from splitserve.proto.messages.grammar_spec import GrammarSpec, json_depth
from splitserve.proto.messages.invalid_request import InvalidRequestError

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# Lark / GBNF lexical pieces whose content is not rule structure.
_LITERALS = re.compile(
    r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*|\[(?:[^\]\\\n]|\\.)*\]'
)
_COMMENT = re.compile(r"(?://|#)[^\n]*")
_GBNF_DEF = re.compile(r"^[ \t]*([A-Za-z_][\w-]*)[ \t]*::=", re.MULTILINE)
_LARK_DEF = re.compile(r"^[ \t]*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][\w-]*")
_LARK_RANGE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_JSON_DIRECTIVE = re.compile(r"%json\s*")


class GrammarLimitError(InvalidRequestError):
    """A constraint beyond a configured bound (or one nothing can satisfy)."""


def check_limits(spec: GrammarSpec, config: GrammarConfig) -> None:
    """Raise GrammarLimitError when spec exceeds a bound of config."""
    if spec.kind == "json_schema":
        check_schema_text(spec.value, config)
    elif spec.kind == "regex":
        check_regex(spec.value, config, "the regex")
    elif spec.kind == "grammar":
        check_grammar_text(spec.value, config)


def check_schema_text(text: str, config: GrammarConfig, what: str = "the JSON schema") -> Any:
    """Depth first (before json.loads may recurse), then the parsed schema. Returns it."""
    depth = json_depth(text, config.max_schema_depth)
    if depth > config.max_schema_depth:
        raise GrammarLimitError(
            f"{what} nests more than {config.max_schema_depth} levels deep; "
            f"the limit is {config.max_schema_depth} (grammar.max_schema_depth)"
        )
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise GrammarLimitError(f"{what} is not valid JSON: {exc}") from None
    check_schema(schema, config, what)
    return schema


def check_schema(schema: Any, config: GrammarConfig, what: str = "the JSON schema") -> None:
    """A parsed schema: its depth, its `pattern` regexes, and whether any value satisfies it."""
    depth = json_depth(json.dumps(schema), config.max_schema_depth)
    if depth > config.max_schema_depth:
        raise GrammarLimitError(
            f"{what} nests more than {config.max_schema_depth} levels deep; "
            f"the limit is {config.max_schema_depth} (grammar.max_schema_depth)"
        )
    stack = [schema]
    while stack:  # depth is bounded above, but walk iteratively anyway
        node = stack.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_regex(pattern, config, f"{what}'s pattern")
            for key in node.get("patternProperties") or {}:
                if isinstance(key, str):
                    check_regex(key, config, f"{what}'s patternProperties")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    reason = unsatisfiable_reason(schema)
    if reason:
        raise GrammarLimitError(f"{what} can never be satisfied: {reason}")


def regex_repeat_bound(pattern: str) -> int:
    """The largest product of nested counted repetitions in a regex ({m}, {m,}, {m,n})."""
    frames = [[1, 1]]  # per group: [the largest product inside it, the last atom's product]
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        frame = frames[-1]
        if ch == "\\":
            i += 2
            if i - 1 < n and pattern[i - 1] in "pPxuN" and i < n and pattern[i] == "{":
                i = pattern.find("}", i) + 1 or n
            frame[1] = 1
            continue
        if ch == "[":
            i = _class_end(pattern, i)
            frame[1] = 1
            continue
        if ch == "(":
            frames.append([1, 1])
        elif ch == ")" and len(frames) > 1:
            inner = frames.pop()[0]
            frames[-1][1] = inner
            frames[-1][0] = max(frames[-1][0], inner)
        elif ch == "{" and (match := _QUANTIFIER.match(pattern, i)):
            low, high = match.group(1), match.group(2)
            count = int(high) if high else int(low)
            frame[1] *= max(count, 1)
            frame[0] = max(frame[0], frame[1])
            i = match.end()
            continue
        else:
            frame[1] = 1
        i += 1
    while len(frames) > 1:  # unbalanced: llguidance reports the syntax error
        inner = frames.pop()[0]
        frames[-1][0] = max(frames[-1][0], inner)
    return frames[0][0]


def _class_end(pattern: str, start: int) -> int:
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def check_regex(pattern: str, config: GrammarConfig, what: str) -> None:
    bound = regex_repeat_bound(pattern)
    if bound > config.max_regex_repeat:
        raise GrammarLimitError(
            f"{what} repeats up to {bound} times; the limit is {config.max_regex_repeat} (grammar.max_regex_repeat)"
        )


def check_grammar_text(text: str, config: GrammarConfig) -> None:
    """GBNF (`root ::= ...`) or Lark: rule count, rule-reference depth, counted repetitions,
    regex literals and embedded %json schemas."""
    for match in _JSON_DIRECTIVE.finditer(text):
        _check_embedded_schema(text, match.end(), config)
    for literal in _LITERALS.finditer(text):
        if literal.group().startswith("/"):
            check_regex(literal.group()[1 : literal.group().rindex("/")], config, "a regex in the grammar")
    stripped = _COMMENT.sub(" ", _LITERALS.sub(" ", _JSON_STRING.sub(" ", text)))
    for match in _QUANTIFIER.finditer(stripped):
        _check_count(match.group(1), match.group(2), config)
    for match in _LARK_RANGE.finditer(stripped):
        _check_count(match.group(1), match.group(2), config)
    definition = _GBNF_DEF if _GBNF_DEF.search(stripped) else _LARK_DEF
    starts = list(definition.finditer(stripped))
    if len(starts) > config.max_rules:
        raise GrammarLimitError(
            f"the grammar defines {len(starts)} rules; the limit is {config.max_rules} (grammar.max_rules)"
        )
    rules: dict[str, set[str]] = {}
    for index, match in enumerate(starts):
        end = starts[index + 1].start() if index + 1 < len(starts) else len(stripped)
        rules.setdefault(match.group(1), set()).update(_NAME.findall(stripped, match.end(), end))
    graph = {name: [ref for ref in refs if ref in rules] for name, refs in rules.items()}
    depth = reference_depth(graph)
    if depth > config.max_rule_depth:
        raise GrammarLimitError(
            f"the grammar's rule references chain {depth} rules deep; "
            f"the limit is {config.max_rule_depth} (grammar.max_rule_depth)"
        )


def _check_count(low: str, high: str | None, config: GrammarConfig) -> None:
    count = int(high) if high else int(low)
    if count > config.max_regex_repeat:
        raise GrammarLimitError(
            f"the grammar repeats an item {count} times; the limit is {config.max_regex_repeat} "
            "(grammar.max_regex_repeat)"
        )


def _check_embedded_schema(text: str, start: int, config: GrammarConfig) -> None:
    end = _json_value_end(text, start, config)
    if end is not None:
        check_schema_text(text[start:end], config, "the grammar's %json schema")


def _json_value_end(text: str, start: int, config: GrammarConfig) -> int | None:
    """Where the JSON object starting at text[start] ends (None: not an object; llguidance says why)."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for match in re.finditer(r'"(?:[^"\\]|\\.)*"|[{}]', text[start:]):
        token = match.group()
        if token == "{":
            depth += 1
            if depth > config.max_schema_depth:
                raise GrammarLimitError(
                    f"the grammar's %json schema nests more than {config.max_schema_depth} levels deep; "
                    f"the limit is {config.max_schema_depth} (grammar.max_schema_depth)"
                )
        elif token == "}":
            depth -= 1
            if not depth:
                return start + match.end()
    return None


def reference_depth(graph: dict[str, list[str]]) -> int:
    """The longest chain of references, a cycle counting all its rules once: the longest
    path through the graph's strongly connected components, each weighing its size
    (Tarjan's algorithm, iterative: the graph may be 100,000 rules deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    component_of: dict[str, int] = {}
    depth_of: list[int] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, edge = work.pop()
            if edge == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            children = graph[node]
            if edge < len(children):
                work.append((node, edge + 1))
                child = children[edge]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            for child in children:  # children done: fold their low links in
                if child in on_stack:
                    low[node] = min(low[node], low[child])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component_of[member] = len(depth_of)
                    members.append(member)
                    if member == node:
                        break
                own = len(depth_of)
                below = [
                    depth_of[component_of[c]] for m in members for c in graph[m] if component_of.get(c, own) != own
                ]
                depth_of.append(len(members) + max(below, default=0))
    return max(depth_of, default=0)
