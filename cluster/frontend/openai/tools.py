"""OpenAI tool calling on the request side: the `tools` / `tool_choice` shapes and the grammar
that makes the model's output a valid call.

- a named function: the output is the function's arguments, generated under its parameter
  schema (the call's name is known up front);
- "required": a JSON array of one or more {"name", "arguments"} objects, each call's
  arguments under its function's schema (at most one call if parallel_tool_calls is false);
- "auto": either a plain answer (text not starting with "<") or one or more
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes / Qwen format);
- "none": no constraint, tools are only shown to the chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.invalid_request import InvalidRequestError

TOOL_CALL_BEGIN, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# A function without `parameters` takes none: its arguments are exactly {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolParam(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCallPlan:
    """How the output of a tool-calling request is constrained and read back."""

    mode: Literal["named", "required", "auto"]
    function_names: tuple[str, ...]  # named: the one forced function
    grammar: GrammarSpec


def _call_schema(tool: ToolParam) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": tool.function.parameters or NO_PARAMETERS,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _any_call_schema(tools: list[ToolParam]) -> dict:
    calls = [_call_schema(t) for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def plan_tool_calls(
    tools: list[ToolParam] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None
) -> ToolCallPlan | None:
    """The constraint for a chat request's tools; None when the output is free text."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise _param_error("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise _param_error("tool function names must be unique", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        by_name = {t.function.name: t for t in tools}
        tool = by_name.get(choice.function.name)
        if tool is None:
            raise _param_error(
                f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice"
            )
        spec = GrammarSpec.json_schema(tool.function.parameters or NO_PARAMETERS)
        return ToolCallPlan("named", (tool.function.name,), spec)
    if choice == "required":
        array = {"type": "array", "items": _any_call_schema(tools), "minItems": 1}
        if parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolCallPlan("required", tuple(names), GrammarSpec.json_schema(array))
    # auto: free text, or tool-call blocks. %json embeds the call schema in the Lark grammar.
    call_repeat = "call" if parallel_tool_calls is False else "call+"
    lark = "\n".join(
        [
            f"start: TEXT | {call_repeat}",
            f"call: {json.dumps(TOOL_CALL_BEGIN)} call_json {json.dumps(TOOL_CALL_END)}",
            f"call_json: %json {json.dumps(_any_call_schema(tools))}",
            r"TEXT: /[^<](.|\n)*/",
        ]
    )
    return ToolCallPlan("auto", tuple(names), GrammarSpec("grammar", lark))


def _param_error(message: str, param: str) -> InvalidRequestError:
    from splitserve.cluster.frontend.openai.protocol import RequestParamError

    return RequestParamError(message, param)
