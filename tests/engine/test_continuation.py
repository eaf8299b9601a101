"""A migrated request's continuation on the colocated engine: the client's stream when its
replica dies after its k-th chunk and the ingress's AnswerSoFar re-submits it (prompt + output
so far, limits reduced, a Continuation) equals the undisturbed stream, for every k: tokens,
text (held-back stop text, include_stop_str_in_output, split characters), log-probabilities,
finish reason and counts; greedy, seeded with penalties and min_tokens, and constrained."""

from __future__ import annotations

import pytest

from splitserve.cluster.ingress.stream_migration import AnswerSoFar
from splitserve.engine.config import EngineConfig
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.continuation import Continuation
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=256))


def stream(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[StreamChunk]:
    """The request's chunks as a decode replica sends them (one per engine step)."""
    rid = engine.add_request(prompt_token_ids=prompt, params=params)
    outputs: list[RequestOutput] = []
    while not outputs or not outputs[-1].finished:
        outputs += [out for out in engine.step() if out.request_id == rid]
    return [
        StreamChunk(
            request_id=rid,
            token_ids=out.new_token_ids,
            text=out.new_text,
            finished=out.finished,
            finish_reason=out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=len(out.token_ids),
            logprobs=out.new_logprobs,
            stop_reason=out.stop_reason if out.finished else None,
        )
        for out in outputs
    ]


def migrated(engine: LLMEngine, params: SamplingParams, kill_after: int) -> list[StreamChunk]:
    """The client's chunks when the replica fails once its kill_after-th chunk was sent."""
    answer = AnswerSoFar(PROMPT, params)
    before = [answer.client_chunk(chunk) for chunk in stream(engine, PROMPT, params)[:kill_after]]
    prompt, continued = answer.continuation()
    return before + [answer.client_chunk(chunk) for chunk in stream(engine, prompt, continued)]


def assert_same_answer(got: list[StreamChunk], want: list[StreamChunk]) -> None:
    assert [t for c in got for t in c.token_ids] == [t for c in want for t in c.token_ids]
    assert "".join(c.text for c in got) == "".join(c.text for c in want)
    assert [lp for c in got for lp in c.logprobs] == pytest.approx([lp for c in want for lp in c.logprobs], abs=1e-4)
    last, reference = got[-1], want[-1]
    assert [c.finished for c in got].count(True) == 1 and last.finished
    assert (last.finish_reason, last.stop_reason) == (reference.finish_reason, reference.stop_reason)
    assert (last.num_prompt_tokens, last.num_output_tokens) == (len(PROMPT), reference.num_output_tokens)
    assert [c.num_output_tokens for c in got] == sorted(c.num_output_tokens for c in got)


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=True),
    "seeded, penalties, min_tokens": SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=20,
        min_tokens=14,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        repetition_penalty=1.3,
        logprobs=True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_kill_point_continues_the_undisturbed_answer(engine, case):
    params = CASES[case]
    reference = stream(engine, PROMPT, params)
    assert len(reference) > 4
    for kill_after in range(1, len(reference)):
        assert_same_answer(migrated(engine, params, kill_after), reference)
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_spanning_the_kill_point_stops_as_without_migration(engine, include):
    free = stream(engine, PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = "".join(c.text for c in free)
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # held back over several steps before it completes
    assert len(stop) == 4
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
    )
    reference = stream(engine, PROMPT, params)
    assert reference[-1].stop_reason == stop
    for kill_after in range(1, len(reference)):
        assert_same_answer(migrated(engine, params, kill_after), reference)


def test_a_constrained_continuation_replays_its_grammar(engine):
    spec = GrammarSpec("regex", "[a-z]{3,8}( [a-z]{3,8}){2,5}")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_output=spec)
    reference = stream(engine, PROMPT, params)
    assert len(reference) > 3
    for kill_after in range(1, len(reference)):
        assert_same_answer(migrated(engine, params, kill_after), reference)


def test_the_continuation_arithmetic():
    params = SamplingParams(max_tokens=10, min_tokens=4, prompt_logprobs=1, seed=3)
    answer = AnswerSoFar([1, 2, 3], params)
    chunk = StreamChunk("r", [7, 8], "ab", False, None, 3, 2, 2, logprobs=[-0.5, -0.25])
    assert answer.client_chunk(chunk) is chunk  # the first attempt's chunks go as they are
    answer.client_chunk(StreamChunk("r", [9], "", False, None, 3, 2, 3, logprobs=[-1.0]))  # text held back
    prompt, continued = answer.continuation()
    assert prompt == [1, 2, 3, 7, 8, 9]
    assert (continued.max_tokens, continued.min_tokens, continued.prompt_logprobs) == (7, 1, None)
    assert continued.continuation == Continuation(3, 2) and continued.seed == 3
    later = answer.client_chunk(StreamChunk("r.1", [4], "cd", True, "length", 6, 5, 1, logprobs=[-2.0]))
    assert (later.num_prompt_tokens, later.num_output_tokens, later.num_cached_tokens) == (3, 4, 2)
    assert later.request_id == "r"  # the id the client saw first
    assert later.logprobs == [-2.0]  # the client's fourth token's: offsets follow the stream
    prompt, again = answer.continuation()  # a second move resumes from the original request
    assert prompt == [1, 2, 3, 7, 8, 9, 4] and (again.max_tokens, again.min_tokens) == (6, 0)
    assert again.continuation == Continuation(4, 4) and answer.num_moves == 2


def test_a_continuation_must_leave_a_prompt(engine):
    params = SamplingParams(max_tokens=4, continuation=Continuation(3, 0))
    with pytest.raises(InvalidRequestError, match="continuation"):
        engine.add_request(prompt_token_ids=[1, 2, 3], params=params)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        Continuation(0, 0)


def test_the_gap_of_a_move_runs_from_the_last_token_before_to_the_first_after():
    """Timed on the answer's clock: a chunk without tokens after the move does not end the gap,
    and a second move before any token came back counts from the last token the client got."""
    times, gaps = iter([1.0, 2.0, 7.5, 8.0, 20.0]), []

    class Observer:
        def gap(self, seconds: float) -> None:
            gaps.append(seconds)

        def recomputed(self, num_tokens: int) -> None:
            pass

    def chunk(*token_ids: int) -> StreamChunk:
        return StreamChunk("r", list(token_ids), "", False, None, len(PROMPT), 0, len(token_ids))

    answer = AnswerSoFar(PROMPT, SamplingParams(max_tokens=10), Observer(), clock=lambda: next(times))
    answer.client_chunk(chunk(1))  # t 1.0
    answer.client_chunk(chunk(2))  # t 2.0: the last token before the failure
    answer.continuation()
    answer.client_chunk(chunk())  # no token: the gap goes on
    answer.continuation()  # moved again before a token came back
    answer.client_chunk(chunk(3))  # t 7.5
    assert gaps == [5.5]
    answer.client_chunk(chunk(4))  # t 8.0: an ordinary token, no gap
    assert gaps == [5.5]


def test_each_move_counts_the_tokens_its_continuation_computed_again():
    """Once per continuation that sent a chunk: its prompt (the client's prompt and answer so
    far) less what its replica found cached; the first attempt's cache hit is not a move's."""
    recomputed = []

    class Observer:
        def gap(self, seconds: float) -> None:
            pass

        def recomputed(self, num_tokens: int) -> None:
            recomputed.append(num_tokens)

    answer = AnswerSoFar([1, 2, 3], SamplingParams(max_tokens=10), Observer())
    answer.client_chunk(StreamChunk("r", [7, 8], "ab", False, None, 3, 0, 2))
    assert recomputed == []
    answer.continuation()
    answer.continuation()  # moved again before its replica sent anything: one count, the next attempt's
    answer.client_chunk(StreamChunk("r.2", [], "", False, None, 5, 2, 0))  # 5 prompt tokens, 2 cached
    answer.client_chunk(StreamChunk("r.2", [9], "c", False, None, 5, 2, 1))
    assert recomputed == [3]
    answer.continuation()
    answer.client_chunk(StreamChunk("r.3", [4], "d", True, "length", 6, 6, 1))  # all cached
    assert recomputed == [3, 0]
