"""Streamed chunks are encoded without pydantic (a prebuilt envelope and one dict per choice):
each must be exactly what the OpenAI chunk models dump to, for every shape a stream takes."""

from __future__ import annotations

import json

import msgspec
import pytest

from splitserve.cluster.frontend.openai.completion_renderer import CompletionRenderer
from splitserve.cluster.frontend.openai.render import SSE_DONE, ChatRenderer
from splitserve.cluster.frontend.openai.responses import ChatCompletionChunk, CompletionResponse
from splitserve.proto.messages.handoff import StreamChunk
from tests.helpers.http_api import MODEL_NAME, tiny_tokenizer

pytestmark = pytest.mark.timeout(60)
MODELS = {CompletionRenderer: CompletionResponse, ChatRenderer: ChatCompletionChunk}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


def chunk(token_ids, text, finished=False, stop_reason=None, top=False) -> StreamChunk:
    return StreamChunk(
        request_id="r",
        token_ids=token_ids,
        text=text,
        finished=finished,
        finish_reason="stop" if finished else None,
        num_prompt_tokens=3,
        num_cached_tokens=1,
        num_output_tokens=0,
        logprobs=[-0.5 - i for i in range(len(token_ids))],
        top_logprobs=[[(t, -0.25), (t + 1, float("-inf"))] for t in token_ids] if top else [],
        stop_reason=stop_reason,
    )


def stream(renderer, chunks: list[tuple[int, StreamChunk]], close: bool = True) -> list[str]:
    events = renderer.opening_events()
    for index, c in chunks:
        events += renderer.chunk_events(c, index)
    return events + (renderer.closing_events() if close else [])


def assert_as_models_dump(cls, events: list[str]) -> list[dict]:
    """Every data event parses, and re-validating it through the chunk model dumps the same
    JSON: same key set, same values (and the exact bytes json.dumps gives that dump)."""
    assert events[-1] == SSE_DONE
    bodies = []
    for event in events[:-1]:
        assert event.startswith("data: ") and event.endswith("\n\n")
        body = json.loads(event[len("data: ") : -2])
        dumped = MODELS[cls].model_validate(body).model_dump(mode="json")
        assert body == dumped
        assert event == f"data: {json.dumps(dumped, ensure_ascii=False)}\n\n"
        bodies.append(body)
    return bodies


@pytest.mark.parametrize("cls", [CompletionRenderer, ChatRenderer])
@pytest.mark.parametrize("logprobs", [False, True])
def test_stream_chunks_are_the_models_dumps(tokenizer, cls, logprobs):
    kwargs = {"num_top_logprobs": 2} if cls is CompletionRenderer and logprobs else {}
    renderer = cls(
        "cmpl-ünï\"code", MODEL_NAME, 1234, tokenizer, logprobs, include_usage=True, n=2, **kwargs
    )  # fmt: skip
    chunks = [
        (0, chunk([5], "hé")),
        (1, chunk([6, 7], '"x"\n', top=logprobs)),
        (0, chunk([], "")),  # nothing new: no event
        (0, chunk([8], "", finished=True, stop_reason=8)),
        (1, chunk([9], "end", finished=True, stop_reason="end")),
    ]
    bodies = assert_as_models_dump(cls, stream(renderer, chunks))
    per_choice = [b["choices"][0] for b in bodies if b["choices"]]
    key = "text" if cls is CompletionRenderer else "delta"
    if cls is ChatRenderer:
        assert [c[key] for c in per_choice[2:]] == [{"content": "hé"}, {"content": '"x"\n'}, {}, {"content": "end"}]
    else:
        assert [c[key] for c in per_choice] == ["hé", '"x"\n', "", "end"]
    assert [c["stop_reason"] for c in per_choice[-2:]] == [8, "end"]
    assert [c["index"] for c in per_choice[-4:]] == [0, 1, 0, 1]
    assert (per_choice[-1]["logprobs"] is not None) == logprobs
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 5
    assert all("usage" not in b for b in bodies[:-1])


@pytest.mark.parametrize("cls", [CompletionRenderer, ChatRenderer])
def test_unfinished_stream_closes_with_abort_chunks(tokenizer, cls):
    """A stream cut short: each choice still gets its finish chunk from closing_events, and
    the completions echo goes ahead of the first text."""
    kwargs = {"echoes": ["Q: "]} if cls is CompletionRenderer else {}
    renderer = cls("r-1", MODEL_NAME, 5, tokenizer, False, include_usage=False, n=2, **kwargs)
    bodies = assert_as_models_dump(cls, stream(renderer, [(0, chunk([5], "a"))]))
    finishes = [b["choices"][0] for b in bodies if b["choices"][0]["finish_reason"]]
    assert [(c["index"], c["finish_reason"], c["stop_reason"]) for c in finishes] == [
        (0, "abort", None),
        (1, "abort", None),
    ]
    if cls is CompletionRenderer:
        assert bodies[0]["choices"][0]["text"] == "Q: a" and finishes[1]["text"] == "Q: "


def test_echoed_prompt_logprobs_stream_as_the_models_dump(tokenizer):
    """Echo with logprobs: the first chunk carries the prompt's entries (null for its first
    token) ahead of the completion's, offsets run on over prompt then completion, and the
    whole response lists the same entries."""
    prompt = [11, 12, 13]
    kwargs = {"echoes": [tokenizer.decode(prompt)], "num_top_logprobs": 2, "echo_token_ids": [prompt]}
    head = msgspec.structs.replace(
        chunk([5], "a", top=True),
        prompt_logprobs=[-1.0, float("-inf")],
        prompt_top_logprobs=[[(12, -1.0)], [(7, -0.5)]],
    )
    chunks = [(0, head), (0, chunk([6], "b", finished=True, top=True))]
    streaming = CompletionRenderer("r", MODEL_NAME, 5, tokenizer, True, include_usage=False, **kwargs)
    bodies = assert_as_models_dump(CompletionRenderer, stream(streaming, chunks))
    first, last = (b["choices"][0]["logprobs"] for b in bodies)
    assert first["token_logprobs"] == [None, -1.0, -9999.0, -0.5]
    assert first["top_logprobs"][0] is None and list(first["top_logprobs"][2]) == [
        tokenizer.decode([7]),
        tokenizer.decode([13]),
    ]
    tokens = first["tokens"] + last["tokens"]
    assert first["text_offset"] + last["text_offset"] == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    whole = CompletionRenderer("r", MODEL_NAME, 5, tokenizer, True, include_usage=False, **kwargs)
    for index, c in chunks:
        whole.observe(c, index)
    logprobs = whole.render_response()["choices"][0]["logprobs"]
    assert (
        logprobs["tokens"] == tokens and logprobs["token_logprobs"] == first["token_logprobs"] + last["token_logprobs"]
    )


@pytest.mark.parametrize("cls", [CompletionRenderer, ChatRenderer])
def test_text_events_from_the_template_are_the_full_rendering(tokenizer, cls):
    """A text-only chunk's event is its choice's template around the encoded text
    (ResponseRenderer.text_event): the same bytes as rendering the choice's dict, for any text,
    and for the served model named after the first event (answered_by renders it afresh)."""
    renderer = cls('r"1', MODEL_NAME, 7, tokenizer, False, include_usage=False, n=2)
    texts = ["", "a", 'q"uo\\te', "line\nnext\ttab", "\x00\x1f\x7f", "ünï 中文 🙂", "\ud800"]

    def full(choice, text: str) -> str:
        return f"{renderer._envelope}{json.dumps(renderer.render_choice(choice, text, 0, None), ensure_ascii=False)}]}}\n\n"

    for name in (MODEL_NAME, "other-model"):
        renderer.answered_by(name)
        for choice in renderer.choices:
            for text in texts:
                event = renderer.text_event(choice, text)
                assert event == full(choice, text)
                assert json.loads(event[len("data: ") : -2])["model"] == name
