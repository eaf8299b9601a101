"""Structured output and tool calling as users reach them: the unmodified `openai` client (and
gRPC) against the production HTTP frontend over a real 1P+1D cluster (prefill and decode
actors, KV over gloo), with the random-weight tiny model. Valid by construction, streamed
and not; bad schemas are 400s that cost nothing; no KV block leaks, disconnects included."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import httpx
import jsonschema
import pytest

from splitserve.bench.serving.json_schemas import MAX_INSTANCE_TOKENS, SCHEMAS, WEATHER_TOOL
from splitserve.cluster.frontend.backend import ServingBackend
from splitserve.proto import load_stubs
from tests.helpers.cluster import cluster_config, grpc_stub, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
pb2, _ = load_stubs()
NAMES = list(SCHEMAS)


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    serving = ServingBackend(cluster_config(tiny_model, num_blocks=512), tiny_model)
    loop.run(serving.start(), timeout=240)
    yield serving
    loop.run(serving.shutdown(), timeout=60)


@pytest.fixture(scope="module")
def client(server):
    from openai import AsyncOpenAI

    return lambda: AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def gather(make_client, coros_of, n: int, limit: int = 32):
    """Run coros_of(client, i) for i < n with at most `limit` in flight; their results in order."""

    async def go():
        sem = asyncio.Semaphore(limit)
        async with make_client() as c:

            async def one(i):
                async with sem:
                    return await coros_of(c, i)

            return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(go())


def request_fields(i: int, chat: bool = True) -> dict:
    """The same schema, asked for in each of the accepted ways."""
    schema = SCHEMAS[NAMES[i % 5]]
    style = (i // 5) % 3
    if style == 0:
        fmt = {"type": "json_schema", "json_schema": {"name": NAMES[i % 5], "schema": schema, "strict": True}}
        return {"response_format": fmt} if chat else {"extra_body": {"response_format": fmt}}
    if style == 1:
        return {"extra_body": {"structured_outputs": {"json": schema}}}
    return {"extra_body": {"guided_json": schema}}


def test_100_json_schema_chat_requests_are_valid(client, backend, loop):
    async def one(c, i):
        res = await c.chat.completions.create(
            model=backend.model_name,
            messages=[{"role": "user", "content": f"A {NAMES[i % 5]} as JSON ({i})"}],
            max_tokens=MAX_INSTANCE_TOKENS,
            seed=i,
            **request_fields(i),
        )
        return res.choices[0]

    for i, choice in enumerate(gather(client, one, 100)):
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[NAMES[i % 5]])
    wait_for_baseline(loop, backend.cluster)


def test_100_json_schema_requests_streamed_are_valid(client, backend, loop):
    async def one(c, i):
        fields = request_fields(i, chat=i % 2 == 0)
        if i % 2:  # completions stream text; chat streams deltas
            stream = await c.completions.create(
                model=backend.model_name,
                prompt=f"JSON {i}:",
                max_tokens=MAX_INSTANCE_TOKENS,
                seed=i,
                stream=True,
                **fields,
            )
            parts = [(ch.choices[0].text, ch.choices[0].finish_reason) async for ch in stream if ch.choices]
        else:
            stream = await c.chat.completions.create(
                model=backend.model_name,
                messages=[{"role": "user", "content": f"JSON {i}"}],
                max_tokens=MAX_INSTANCE_TOKENS,
                seed=i,
                stream=True,
                **fields,
            )
            parts = [
                (ch.choices[0].delta.content or "", ch.choices[0].finish_reason) async for ch in stream if ch.choices
            ]
        return "".join(text for text, _ in parts), [f for _, f in parts if f][-1]

    for i, (text, finish) in enumerate(gather(client, one, 100)):
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), SCHEMAS[NAMES[i % 5]])
    wait_for_baseline(loop, backend.cluster)


def test_regex_choice_and_grammar_fields(client, backend, loop):
    regex = r"[a-z]{3}-[0-9]{3}"
    choices = ["positive", "negative", "neutral"]

    async def one(c, i):
        extra = [
            {"guided_regex": regex},
            {"structured_outputs": {"regex": regex}},
            {"guided_choice": choices},
            {"structured_outputs": {"choice": choices}},
            {"guided_grammar": 'root ::= "id:" [0-9] [0-9]'},
        ][i % 5]
        res = await c.completions.create(
            model=backend.model_name, prompt="Label:", max_tokens=32, seed=i, extra_body=extra
        )
        return res.choices[0]

    for i, choice in enumerate(gather(client, one, 15)):
        assert choice.finish_reason == "stop", choice
        check = (
            [lambda t: re.fullmatch(regex, t)] * 2
            + [lambda t: t in choices] * 2
            + [lambda t: re.fullmatch(r"id:\d\d", t)]
        )
        assert check[i % 5](choice.text), (i, choice.text)
    wait_for_baseline(loop, backend.cluster)


def tool_schema() -> dict:
    return WEATHER_TOOL["function"]["parameters"]


def test_forced_tool_calls(client, backend, loop):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def one(c, i):
        choice_kind = named if i % 2 == 0 else "required"
        # One call: a random model would otherwise keep appending calls until max_tokens.
        one_call = {"parallel_tool_calls": False}
        if i < 4:
            res = await c.chat.completions.create(
                model=backend.model_name,
                messages=messages,
                tools=[WEATHER_TOOL],
                tool_choice=choice_kind,
                seed=i,
                max_tokens=96,
                **one_call,
            )
            return (
                res.choices[0].finish_reason,
                [(t.id, t.function.name, t.function.arguments) for t in res.choices[0].message.tool_calls or []],
                res.choices[0].message.content,
            )
        stream = await c.chat.completions.create(
            model=backend.model_name,
            messages=messages,
            tools=[WEATHER_TOOL],
            tool_choice=choice_kind,
            seed=i,
            max_tokens=96,
            **one_call,
            stream=True,
        )
        calls: dict[int, list] = {}
        finish = content = None
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content = (content or "") + (delta.content or "") if delta.content else content
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, [None, None, ""])
                entry[0] = tc.id or entry[0]
                entry[1] = (tc.function.name if tc.function else None) or entry[1]
                entry[2] += (tc.function.arguments if tc.function else None) or ""
            finish = chunk.choices[0].finish_reason or finish
        return finish, [tuple(v) for _, v in sorted(calls.items())], content

    for finish, calls, content in gather(client, one, 8):
        assert finish == "tool_calls" and calls and content is None, (finish, calls, content)
        for call_id, name, arguments in calls:
            assert call_id.startswith("call_") and name == "get_weather"
            jsonschema.validate(json.loads(arguments), tool_schema())
    wait_for_baseline(loop, backend.cluster)


def test_auto_tool_choice_answers_or_calls(client, backend):
    async def one(c, i):
        res = await c.chat.completions.create(
            model=backend.model_name,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[WEATHER_TOOL],
            seed=i,
            max_tokens=24,
        )
        return res.choices[0]

    for choice in gather(client, one, 4):
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), tool_schema())
        else:  # a random model answers in text: never starting like a tool call
            assert choice.message.content and not choice.message.content.startswith("<")


def test_invalid_constraints_are_400_and_the_server_keeps_serving(client, backend, server, loop):
    import openai

    bad = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "nope",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "regex"),
        ({"extra_body": {"guided_grammar": "start: missing_rule"}}, "missing_rule"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "one output constraint"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ]

    async def one(c, i):
        fields, needle = bad[i]
        try:
            await c.chat.completions.create(
                model=backend.model_name, messages=[{"role": "user", "content": "x"}], max_tokens=8, **fields
            )
        except openai.BadRequestError as exc:
            return needle in exc.message, exc.message
        return False, "no error"

    for ok, message in gather(client, one, len(bad)):
        assert ok, message
    wait_for_baseline(loop, backend.cluster)
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"model": backend.model_name, "prompt": "Hi", "max_tokens": 3}, timeout=60
    )
    assert ok.status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'^splitserve_structured_requests_total\{kind="json_schema",model_name="[^"]*"\}', metrics, re.M)
    assert "splitserve_grammar_compile_seconds_count" in metrics


def test_client_disconnect_mid_constrained_stream_frees_blocks(backend, server, loop):
    body = {
        "model": backend.model_name,
        "prompt": "Order:",
        "max_tokens": MAX_INSTANCE_TOKENS,
        "stream": True,
        "guided_json": SCHEMAS["order"],
    }
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for n, _ in enumerate(resp.iter_lines()):
            if n >= 6:
                break  # leave mid-stream
    wait_for_baseline(loop, backend.cluster)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'splitserve_grammar_mask_steps_total\{model_name="[^"]*",pool="decode"\} [1-9]', metrics), (
        metrics[-2000:]
    )


def test_grpc_generate_with_structured_output(backend, loop):
    with grpc_stub(loop, backend) as stub:
        schema = SCHEMAS["weather"]
        request = pb2.GenerateRequest(
            text="Weather:", max_tokens=MAX_INSTANCE_TOKENS, seed=1, json_schema=json.dumps(schema)
        )
        responses = list(stub.Generate(request, timeout=60))
        assert responses[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(r.text for r in responses)), schema)
        choice = pb2.GenerateRequest(text="Pick:", max_tokens=8, choice=pb2.Choices(choices=["up", "down"]))
        assert "".join(r.text for r in stub.Generate(choice, timeout=60)) in ("up", "down")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb2.GenerateRequest(text="x", regex="[a-"), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in err.value.details()
    wait_for_baseline(loop, backend.cluster)
