"""LLMEngine's worker API without Ray: a prefill-only engine and a decode engine in one process,
with the KV copied between their caches by hand, give the colocated engine's tokens; every
release path returns both block pools to baseline."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.engine_stats import EngineStats
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
