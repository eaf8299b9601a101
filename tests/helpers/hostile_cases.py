"""Hand-written hostile requests for the hostile-input tests (tests/cluster/frontend/hostile/)."""

from __future__ import annotations

import json


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def raw_completion_cases(model: str) -> list[tuple[str, bytes, int, str]]:
    """(name, body, status, a word the message must contain) for /v1/completions."""
    head = b'{"model": "' + model.encode() + b'", '
    return [
        ("invalid UTF-8 in a string", head + b'"prompt": "caf\xc3\x28 \xff\xfe"}', 400, "pars"),
        ("invalid UTF-8 in a key", head + b'"\xc3\x28": 1, "prompt": "x"}', 400, "pars"),
        ("lone surrogate escape", head + b'"prompt": "a\\ud800b"}', 400, "Unicode"),
        ("not JSON", b"\x00\x01\x02 definitely not json", 400, ""),
        ("truncated JSON", head + b'"prompt": "x", "max_tokens": ', 400, "JSON"),
        ("deeply nested array body", _nested(30_000), 400, ""),
        (
            "deeply nested prompt",
            head + b'"prompt": ' + _nested(5_000)[:5_000] + b"1" + _nested(5_000)[5_000:] + b"}",
            400,
            "",
        ),
        (
            "deeply nested unknown field",
            head + b'"prompt": "x", "extra": ' + b'{"a":' * 5_000 + b"1" + b"}" * 5_000 + b"}",
            400,
            "",
        ),
        (
            "moderately nested unknown field",
            head + b'"prompt": "x", "max_tokens": 2, "extra": ' + _nested(200) + b"}",
            200,
            "",
        ),
        ("huge max_tokens", head + b'"prompt": "x", "max_tokens": 1000000000000}', 400, "max_tokens"),
        ("max_tokens beyond int64", head + b'"prompt": "x", "max_tokens": ' + b"9" * 40 + b"}", 400, "max_tokens"),
        ("max_tokens with 5000 digits", head + b'"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, ""),
        ("negative max_tokens", head + b'"prompt": "x", "max_tokens": -5}', 400, "max_tokens"),
        ("NaN temperature", head + b'"prompt": "x", "temperature": NaN}', 400, "temperature"),
        (
            "thousands of stop strings",
            head + b'"prompt": "x", "stop": ' + json.dumps(["s"] * 5000).encode() + b"}",
            400,
            "at most 64",
        ),
        ("a huge stop string", head + b'"prompt": "x", "stop": "' + b"s" * 5000 + b'"}', 400, "stop"),
        (
            "thousands of stop token ids",
            head
            + b'"prompt": "x", "max_tokens": 2, "stop_token_ids": '
            + json.dumps([i % 500 for i in range(3000)]).encode()
            + b"}",
            200,
            "",
        ),
        (
            "stop token id beyond int64",
            head + b'"prompt": "x", "stop_token_ids": [' + b"9" * 30 + b"]}",
            400,
            "vocabulary",
        ),
        ("top_k beyond int64", head + b'"prompt": "x", "top_k": ' + b"9" * 30 + b"}", 400, "top_k"),
        ("token id out of the vocabulary", head + b'"prompt": [1, 2, 99999999]}', 400, "vocabulary"),
        ("prompt longer than the cache", head + b'"prompt": ' + json.dumps([5] * 500).encode() + b"}", 400, "tokens"),
        ("a batch of prompts", head + b'"prompt": ["a", "b"], "max_tokens": 2}', 200, ""),
        (
            "a batch with a token id out of the vocabulary",
            head + b'"prompt": [[1], [2, 99999999]], "echo": true}',
            400,
            "vocabulary",
        ),
        ("too many choices", head + b'"prompt": ["a", "b"], "n": 100}', 400, "prompts x n"),
        ("array instead of object", b'["model", "prompt"]', 400, "JSON object"),
    ]


MALFORMED_GRPC = [
    ("Generate", b"\x0a\xff"),  # a length running past the end
    ("Generate", b"\x12\x03\xff\xfe\xfd"),  # text (field 2): invalid UTF-8
    ("Generate", b"\x1a\x05\x0a\x03\xff\xff\xff"),  # token_ids: a truncated packed varint
    ("Generate", b"\x20" + b"\xff" * 11),  # max_tokens: a varint of 11 bytes
    ("Generate", b"\x0f\x00"),  # an invalid wire type
    ("Generate", b"\xff" * 64),
    ("Tokenize", b"\x12\x02\xc3\x28"),  # text: invalid UTF-8
    ("Models", b"\x08"),  # a field with no value
]


def deep_gbnf_chain(depth: int) -> str:
    """`root ::= r0`, `r0 ::= r1`, ... `r{depth} ::= "a"`: llguidance segfaults at 10,000."""
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(depth)) + f'r{depth} ::= "a"\n'


def deep_json(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def hostile_constraints() -> dict:
    """name -> (GrammarSpec, a word the refusal names): each is refused before llguidance."""
    from splitserve.proto.messages.grammar_spec import GrammarSpec

    return {
        "10,000-deep GBNF chain": (GrammarSpec("grammar", deep_gbnf_chain(10_000)), "max_rules"),
        "1,500-deep Lark chain": (
            GrammarSpec("grammar", "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(1500)) + 'r1500: "a"'),
            "max_rule_depth",
        ),
        "a{1000000}": (GrammarSpec("regex", "a{1000000}"), "max_regex_repeat"),
        "(a{1000}){1000}": (GrammarSpec("regex", "(a{1000}){1000}"), "max_regex_repeat"),
        "GBNF repeat": (GrammarSpec("grammar", 'root ::= "a"{20000}'), "max_regex_repeat"),
        "Lark regex literal": (GrammarSpec("grammar", "start: /a{20000}/"), "max_regex_repeat"),
        "schema pattern": (GrammarSpec.json_schema({"type": "string", "pattern": "a{99999}"}), "max_regex_repeat"),
        '{"$ref": "#"}': (GrammarSpec("json_schema", '{"$ref": "#"}'), "never be satisfied"),
        "required self-reference": (
            GrammarSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            "never be satisfied",
        ),
        "%json self-reference": (GrammarSpec("grammar", 'start: x\nx: %json {"$ref": "#"}'), "never be satisfied"),
    }


# Refusals of schema-valid requests that /openapi.json cannot state: they depend on state (the
# model's length, this test's 4-block KV cache), compare two fields, or judge the language
# inside a string (a regex, grammar or schema that does not parse or compile).
POSITIVE_REFUSALS = (
    "exceeds the model's context",  # state: prompt + max_tokens vs the model's length
    "KV cache",  # state: the pools' cache size
    "min_tokens must be",  # relational: min_tokens <= max_tokens
    "prompts x n",  # relational: prompts x n <= 128
    "needs stream_options.include_usage",  # relational: return_first_token_stages with stream
    "give one output constraint",  # relational: two constraint fields at once
    "tool function names must be unique",  # relational: across the tools list
    "which is not among the tools",  # relational: tool_choice vs tools
    "invalid ",  # a regex / grammar / schema string that does not compile
    "can never be satisfied",  # a schema or grammar no output matches
    "grammar.max_",  # a constraint over a configured bound
)


def _pb2():
    from splitserve.proto import load_stubs

    return load_stubs()[0]


HOSTILE_HTTP = [
    ("/v1/completions", {"guided_grammar": deep_gbnf_chain(10_000)}, "guided_grammar", "max_rules"),
    ("/v1/completions", {"guided_json": deep_json(10_000)}, "guided_json", "levels deep"),
    ("/v1/completions", {"structured_outputs": {"json": "[" * 10_000 + "]" * 10_000}}, "structured_outputs", "deep"),
    ("/v1/completions", {"guided_regex": "a{1000000}"}, "guided_regex", "max_regex_repeat"),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
        "response_format",
        "never be satisfied",
    ),
    (
        "/v1/chat/completions",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
        "never be satisfied",
    ),
    ("/v1/completions", {"guided_regex": "[^\\s\\S]"}, "guided_regex", "never be satisfied"),
]
HOSTILE_GRPC = [
    (_pb2().GenerateRequest(text="x", grammar=deep_gbnf_chain(10_000)), "grammar", "max_rules"),
    (_pb2().GenerateRequest(text="x", json_schema=deep_json(10_000)), "json_schema", "levels deep"),
    (_pb2().GenerateRequest(text="x", regex="a{1000000}"), "regex", "max_regex_repeat"),
    (_pb2().GenerateRequest(text="x", json_schema='{"$ref": "#"}'), "json_schema", "never be satisfied"),
]
