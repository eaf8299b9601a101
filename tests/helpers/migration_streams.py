"""The clients of the migration tests: streams over the OpenAI HTTP API (the openai client:
completions and chat, structured output and tool calls included) and gRPC, each collected as
one answer (text, tool calls, token ids, log-probabilities, the ids and `created` it carried,
finish reason, usage), to compare with an undisturbed run's; and the kill point: the decode
replicas hold their steps at an output length until every stream there has it."""

from __future__ import annotations

import pytest
import ray

from splitserve.proto import load_stubs
from tests.helpers.cluster import wait_until

pb2, pb2_grpc = load_stubs()


def new_answer() -> dict:
    return {"text": "", "logprobs": [], "offsets": [], "ids": set(), "created": set(), "usage": None, "finish": None}


def chunk_choices(answer: dict, chunk) -> list:
    """An OpenAI stream chunk's choices (the one choice, index 0), its id, `created` and usage
    recorded in answer on the way."""
    answer["ids"].add(chunk.id)
    answer["created"].add(chunk.created)
    if chunk.usage is not None:
        answer["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    for choice in chunk.choices:
        assert choice.index == 0
    return chunk.choices


def http_answer(client, model: str, prompt: list[int], fields: dict) -> dict:
    """A streamed /v1/completions answer (one choice)."""
    fields = dict(fields)
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **fields,
    )
    answer = new_answer()
    for chunk in stream:
        for choice in chunk_choices(answer, chunk):
            answer["text"] += choice.text
            answer["logprobs"] += choice.logprobs.token_logprobs
            answer["offsets"] += choice.logprobs.text_offset
            answer["finish"] = choice.finish_reason or answer["finish"]
    return answer


def chat_answer(client, model: str, message: str, fields: dict) -> dict:
    """A streamed /v1/chat/completions answer: its content, or its tool calls as
    (id, name, arguments) in order of index."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": message}],
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        **fields,
    )
    answer, calls = new_answer(), {}
    for chunk in stream:
        for choice in chunk_choices(answer, chunk):
            answer["text"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", "", ""])
                entry[0] += call.id or ""
                entry[1] += (call.function.name if call.function else None) or ""
                entry[2] += (call.function.arguments if call.function else None) or ""
            answer["logprobs"] += (
                [entry.logprob for entry in (choice.logprobs.content or [])] if choice.logprobs else []
            )
            answer["finish"] = choice.finish_reason or answer["finish"]
    answer["tool_calls"] = [tuple(calls[i]) for i in sorted(calls)]
    return answer


def grpc_answer(stub, prompt: list[int], fields: dict) -> dict:
    request = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=prompt), ignore_eos=True, logprobs=True, **fields)
    answer = new_answer() | {"token_ids": []}
    for response in stub.Generate(request, timeout=240):
        answer["ids"].add(response.request_id)
        answer["token_ids"] += response.token_ids
        answer["text"] += response.text
        answer["logprobs"] += response.logprobs
        if response.finished:
            answer["finish"] = response.finish_reason
            answer["usage"] = (response.usage.prompt_tokens, response.usage.completion_tokens)
    return answer


def assert_same(got: dict, want: dict) -> None:
    """One answer (one id, one `created`) equal to its undisturbed reference; tool call ids
    are per request, so only their form is compared."""
    assert len(got["ids"]) == 1 and len(got["created"]) <= 1
    assert got["text"] == want["text"] and got.get("token_ids") == want.get("token_ids")
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)
    assert got["offsets"] == want["offsets"]
    assert (got["finish"], got["usage"]) == (want["finish"], want["usage"])
    got_calls, want_calls = got.get("tool_calls", []), want.get("tool_calls", [])
    assert [c[1:] for c in got_calls] == [c[1:] for c in want_calls]
    assert all(c[0].startswith("call_") for c in got_calls)


def hold_decode_steps(cluster, hold_at: int, killed: str | None = None) -> None:
    """Arm every live decode replica but `killed` to hold at hold_at output tokens (0 releases)."""
    handles = [r.handle for r in cluster.decode_pool.live_replicas() if r.replica_id != killed]
    ray.get([h.inject_fault.remote(hold_at_output_tokens=hold_at) for h in handles], timeout=10)


def wait_for_every_stream_held(cluster, num_streams: int) -> list[str]:
    """The kill point: num_streams streams are on decode replicas (past their first token),
    and every decode replica streaming holds its steps (hold_decode_steps), so each stream
    there has the output length and none can finish; the decode replica of each stream, in
    the order the streams were submitted."""

    def held() -> bool:
        inflight, waiting = cluster.dispatcher.inflight, cluster.dispatcher.inflight_prefill
        if len(inflight) < num_streams or waiting:
            return False
        handles = [cluster.decode_pool.get(replica_id).handle for replica_id in set(inflight.values())]
        return all(ray.get([h.holding.remote() for h in handles], timeout=10))

    # A deadline of its own: this runs on the tests' killer threads too, which no test timeout reaches.
    wait_until(held, 240, "the decode replicas never held every stream", 0.05)
    return list(cluster.dispatcher.inflight.values())


def kill_busiest(cluster, inflight: list[str]) -> str:
    """At the kill point: ray.kill the decode replica streaming most; the other goes on."""
    victim_id = max(set(inflight), key=inflight.count)
    ray.kill(cluster.decode_pool.get(victim_id).handle)
    hold_decode_steps(cluster, 0, killed=victim_id)  # the survivors go on (the moved streams too)
    return victim_id
