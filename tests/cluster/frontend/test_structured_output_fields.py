"""Request fields -> GrammarSpec, and tool-call output -> OpenAI tool_calls (no server; the
end-to-end behaviour is in test_structured_output_http.py)."""

from __future__ import annotations

import json

import pytest

from splitserve.bench.serving.json_schemas import PERSON, WEATHER_TOOL
from splitserve.cluster.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestParamError,
    build_sampling_params,
)
from splitserve.cluster.frontend.openai.tool_call_output import ToolCallOutput
from splitserve.proto.messages.grammar_spec import GrammarSpec

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def spec_of(request) -> GrammarSpec | None:
    return build_sampling_params(request, 5, 1024).structured_output


def test_every_accepted_spelling_gives_the_same_spec():
    expected = GrammarSpec.json_schema(PERSON)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert spec_of(chat(response_format=fmt)) == expected
    assert spec_of(chat(structured_outputs={"json": PERSON})) == expected
    assert spec_of(chat(guided_json=PERSON)) == expected
    assert spec_of(chat(guided_json=json.dumps(PERSON))) == expected
    assert spec_of(CompletionRequest.model_validate({"model": "m", "prompt": "x", "response_format": fmt})) == expected
    assert spec_of(chat(response_format={"type": "json_object"})) == GrammarSpec("json_object")
    assert spec_of(chat(response_format={"type": "text"})) is None
    assert spec_of(chat(guided_choice=["a", "b"])) == GrammarSpec.choice(["a", "b"])
    assert spec_of(chat(structured_outputs={"regex": "a+"})) == GrammarSpec("regex", "a+")
    assert spec_of(chat(guided_grammar='root ::= "a"')) == GrammarSpec("grammar", 'root ::= "a"')
    assert spec_of(chat()) is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
        ({"guided_choice": []}, None),
    ],
)
def test_conflicting_or_malformed_constraints_are_refused(fields, param):
    with pytest.raises(RequestParamError if param else ValueError) as err:
        spec_of(chat(**fields))
    if param:
        assert err.value.param == param


def test_tool_choice_modes():
    named = chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert spec_of(named) == GrammarSpec.json_schema(WEATHER_TOOL["function"]["parameters"])
    required = json.loads(spec_of(chat(tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False)).value)
    assert required["maxItems"] == 1 and required["items"]["properties"]["name"] == {"const": "get_weather"}
    auto = spec_of(chat(tools=[WEATHER_TOOL]))  # auto is the default with tools
    assert auto.kind == "grammar" and "<tool_call>" in auto.value
    assert spec_of(chat(tools=[WEATHER_TOOL], tool_choice="none")) is None


def test_tool_call_output_whole_and_streamed():
    args = '{"city":"Paris","unit":"celsius"}'
    named = ToolCallOutput(chat(tools=[WEATHER_TOOL], tool_choice="required").tool_call_plan())
    content, calls, finish = named.message(f'[{{"name":"get_weather","arguments":{args}}}]', "stop")
    assert content is None and finish == "tool_calls" and json.loads(calls[0].function.arguments) == json.loads(args)
    assert named.message('[{"name":"get_w', "length") == ('[{"name":"get_w', None, "length")

    auto = ToolCallOutput(chat(tools=[WEATHER_TOOL]).tool_call_plan())
    text = f'<tool_call>{{"name":"get_weather","arguments":{args}}}</tool_call>'
    assert auto.stream_deltas(text[:5], text[:5]) == []  # a call is held back until complete
    deltas, finish = auto.final_deltas(text, "stop")
    assert finish == "tool_calls" and deltas[0].tool_calls[0].function.name == "get_weather"
    answer = ToolCallOutput(chat(tools=[WEATHER_TOOL]).tool_call_plan())
    assert answer.stream_deltas("Hello", "Hello")[0].content == "Hello"
    assert answer.final_deltas("Hello", "length") == ([], "length")

    forced = chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    stream = ToolCallOutput(forced.tool_call_plan())
    first, second = stream.stream_deltas('{"city"', '{"city"'), stream.stream_deltas(":1}", '{"city":1}')
    assert first[0].tool_calls[0].function.name == "get_weather" and first[0].tool_calls[0].id.startswith("call_")
    assert second[0].tool_calls[0].id is None and second[0].tool_calls[0].function.arguments == ":1}"
