"""LLMEngine's worker API without Ray: a prefill-only engine and a decode engine in one process,
with the KV copied between their caches by hand, give the colocated engine's tokens; every
release path returns both block pools to baseline."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.handoff import PrefillResult
from splitserve.proto.messages.kv_events import STORED
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.handoff import finish_all, hand_off, run_prefill

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine_for(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=BS, **kw))


def assert_baseline(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_running == stats.num_waiting == 0


def prompts() -> list[list[int]]:
    # shorter than a block, exactly one block, exactly three blocks, and ragged lengths
    return [[(7 * i + 3 * n) % 400 + 20 for i in range(n)] for n in (3, 16, 48, 21, 70)]


def test_handoff_by_hand_matches_colocated(tiny_model):
    reference = [o.token_ids for o in engine_for(tiny_model).generate(prompts(), GREEDY)]
    prefill, decode = engine_for(tiny_model), engine_for(tiny_model)
    outputs: dict[str, list[RequestOutput]] = {}
    for i, ids in enumerate(prompts()):
        first, indices = hand_off(prefill, decode, ids, GREEDY, f"r{i}")
        assert indices == list(range(-(-len(ids) // BS)))  # nothing cached yet on decode
        assert first.new_token_ids == first.token_ids and not first.finished
        outputs[f"r{i}"] = [first]
    finish_all(decode, outputs)
    for i, expected in enumerate(reference):
        outs = outputs[f"r{i}"]
        assert [t for o in outs for t in o.new_token_ids] == expected == outs[-1].token_ids
        assert outs[-1].finish_reason == "length" and outs[-1].text == "".join(o.new_text for o in outs)
    assert_baseline(prefill)
    assert_baseline(decode)

    # Decode now caches the three-block prompt: a prompt sharing those blocks receives only the rest.
    shared = prompts()[2] + [5, 6, 7, 8, 9]
    first, indices = hand_off(prefill, decode, shared, GREEDY, "shared")
    assert indices == [3]
    outputs = {"shared": [first]}
    finish_all(decode, outputs)
    assert outputs["shared"][-1].token_ids == engine_for(tiny_model).generate([shared], GREEDY)[0].token_ids
    assert_baseline(decode)


def test_first_token_can_finish_the_request(tiny_model):
    prefill, decode = engine_for(tiny_model), engine_for(tiny_model)
    ids = prompts()[3]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=True)
    out, _ = hand_off(prefill, decode, ids, one, "one")
    assert out.finished and out.finish_reason == "length" and len(out.logprobs) == 1
    first_token = out.token_ids[0]
    stop = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[first_token])
    out, _ = hand_off(prefill, decode, ids, stop, "stop")
    assert out.finished and out.finish_reason == "stop" and out.token_ids == [first_token]
    assert not decode.has_unfinished()
    assert_baseline(prefill)
    assert_baseline(decode)


def test_every_release_path_frees_the_blocks(tiny_model):
    decode = engine_for(tiny_model, num_kv_blocks=8)
    ids = prompts()[4]  # 70 tokens: 5 blocks
    for release in ("release_reservation", "abort"):
        seq = decode.make_sequence(None, ids, GREEDY, release)
        assert decode.reserve_prompt_blocks(seq) is not None
        assert decode.stats().num_free_blocks == 3
        with pytest.raises(ValueError, match="duplicate"):
            decode.reserve_prompt_blocks(seq)
        getattr(decode, release)(release)
        assert_baseline(decode)
    held = decode.make_sequence(None, ids, GREEDY, "held")
    assert decode.reserve_prompt_blocks(held) is not None
    short = decode.make_sequence(None, ids, GREEDY, "short")
    assert decode.reserve_prompt_blocks(short) is None  # 3 free, 5 needed: holds nothing
    assert decode.stats().num_free_blocks == 3
    decode.abort("held")
    decode.release_reservation("never-reserved")  # unknown ids are ignored
    assert_baseline(decode)

    prefill = engine_for(tiny_model)
    prefill.add_sequence(prefill.make_sequence(None, ids, GREEDY, "queued", prefill_only=True))
    prefill.release_prefilled("queued")  # not prefilled yet: aborted
    run_prefill(prefill, ids, GREEDY, "pinned")
    assert prefill.stats().num_free_blocks < prefill.stats().num_blocks  # pinned until released
    prefill.release_prefilled("pinned")
    prefill.release_prefilled("pinned")  # twice is harmless
    assert_baseline(prefill)


def test_events_snapshot_and_stats(tiny_model):
    engine = engine_for(tiny_model)
    assert engine.take_events() == [] and engine.snapshot() == (0, [])
    run_prefill(engine, prompts()[2], GREEDY, "p")  # three full blocks
    events = engine.take_events()
    assert [e.kind for e in events] == [STORED] and len(events[0].block_hashes) == 3
    seq, hashes = engine.snapshot()
    assert seq == events[-1].seq and sorted(hashes) == sorted(events[0].block_hashes)
    stats = engine.stats()
    assert isinstance(stats, EngineStats)
    assert stats.num_blocks - stats.num_free_blocks == 3 and stats.kv_usage == 3 / 64
    assert stats.num_computed_prompt_tokens == 48 and stats.num_prefix_hit_tokens == 0
    engine.release_prefilled("p")
    assert_baseline(engine)
    assert engine.device == engine.kv_cache.kv.device


def test_an_early_first_token_streams_before_its_kv_and_changes_nothing_after(tiny_model):
    """accept_first_token: the first output leaves before the KV is in, while the sequence waits
    outside every batch; the stream is the one admit_prefilled alone gives, token for token and
    text for text (logprobs too)."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=2)
    streams: dict[bool, dict[str, list[RequestOutput]]] = {}
    for early in (False, True):
        prefill, decode = engine_for(tiny_model), engine_for(tiny_model)
        outputs: dict[str, list[RequestOutput]] = {}
        for i, ids in enumerate(prompts()):
            first, _ = hand_off(prefill, decode, ids, params, f"r{i}", early=early)
            assert first.new_token_ids == first.token_ids and not first.finished
            outputs[f"r{i}"] = [first]
        finish_all(decode, outputs)
        streams[early] = outputs
        assert_baseline(prefill)
        assert_baseline(decode)
    late, early_outs = streams[False], streams[True]
    for rid, outs in late.items():
        fields = ("new_token_ids", "new_text", "new_logprobs", "new_top_logprobs", "finished", "finish_reason")
        assert [[getattr(o, f) for f in fields] for o in early_outs[rid]] == [
            [getattr(o, f) for f in fields] for o in outs
        ]


def test_an_early_first_token_waits_outside_the_batch_and_its_abort_frees_everything(tiny_model):
    prefill, decode = engine_for(tiny_model), engine_for(tiny_model)
    running, _ = hand_off(prefill, decode, prompts()[1], GREEDY, "running")
    ids = prompts()[4]
    seq = decode.make_sequence(None, ids, GREEDY, "waiting")
    reservation = decode.reserve_prompt_blocks(seq)
    first = run_prefill(prefill, ids, GREEDY, "waiting")
    result = _result("waiting", first.new_token_ids[0], len(reservation.block_indices))
    early = decode.accept_first_token("waiting", result)
    assert early is not None and early.token_ids == first.new_token_ids
    assert decode.accept_first_token("waiting", result) is None  # once
    # Its KV is not in: the running request steps on, the waiting one is in no step.
    stepped = {out.request_id for _ in range(4) for out in decode.step()}  # async: a step's outputs come a step late
    assert stepped == {"running"}
    decode.abort("waiting")
    decode.abort("running")
    prefill.release_prefilled("waiting")
    assert_baseline(prefill)
    assert_baseline(decode)


@pytest.mark.parametrize("case", ["max_tokens_1", "stop_token", "stop_string", "eos"])
def test_a_first_token_that_may_end_the_request_is_not_taken_early(tiny_model, case):
    """A first token that may finish the request (check_stop or a stop string) is left to
    admit_prefilled, whose output is the finished one once the blocks can go."""
    prefill, decode = engine_for(tiny_model), engine_for(tiny_model)
    ids = prompts()[3]
    first_token = run_prefill(prefill, ids, GREEDY, "probe").token_ids[0]
    prefill.release_prefilled("probe")
    params = {
        "max_tokens_1": SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        "stop_token": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[first_token]),
        "stop_string": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["never in the text"]),
        "eos": SamplingParams(temperature=0, max_tokens=8),
    }[case]
    if case == "eos":
        decode.scheduler.eos_token_ids = {first_token}
    reservation = decode.reserve_prompt_blocks(decode.make_sequence(None, ids, params, case))
    first = run_prefill(prefill, ids, params, case)
    result = _result(case, first.new_token_ids[0], len(reservation.block_indices))
    assert decode.accept_first_token(case, result) is None
    prefill.release_prefilled(case)
    out = decode.admit_prefilled(case, result)
    assert out is not None and out.token_ids == [first_token]
    assert out.finished == (case != "stop_string")
    decode.abort(case)
    assert_baseline(prefill)
    assert_baseline(decode)


def _result(request_id: str, first_token: int, num_blocks: int) -> PrefillResult:
    return PrefillResult(
        request_id=request_id,
        first_token=first_token,
        first_logprob=None,
        num_cached_tokens=0,
        num_blocks_sent=num_blocks,
        num_bytes_sent=0,
        prefill_seconds=0.0,
        transfer_seconds=0.0,
    )
