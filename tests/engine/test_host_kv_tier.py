"""The host KV tier in the engine (kv_offloading_size): a multi-turn workload on a device pool
too small to keep it forces evictions, and later turns load their history back from host memory
instead of recomputing it -- with greedy output identical to the engine without the tier, in
the colocated engine and across a hand-off, and both pools back to baseline after it."""

from __future__ import annotations

import pytest

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.ops.host_kv_cache import num_host_blocks
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.engine.test_worker_api import BS, assert_baseline, finish_all, hand_off

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TIER_GIB = 0.002  # ~250 blocks of the tiny model's 8 KiB: holds the whole workload
SYSTEM = [(5 * i) % 300 + 40 for i in range(24)]


def _engine(model, tier: float, num_kv_blocks: int = 12) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(model), block_size=BS, num_kv_blocks=num_kv_blocks, kv_offloading_size=tier)
    )


def _turn(conv: int, turn: int) -> list[int]:
    return [(11 * conv + 7 * turn + 3 * i) % 300 + 60 for i in range(13)]


def _chat(engine: LLMEngine, num_convs: int = 5, num_turns: int = 3) -> list[list[int]]:
    """num_convs conversations, one turn of each at a time; every turn re-sends the history
    (a shared system prompt, earlier turns and answers). The outputs, in order."""
    history = {c: list(SYSTEM) for c in range(num_convs)}
    outputs = []
    for turn in range(num_turns):
        for c in range(num_convs):
            history[c] += _turn(c, turn)
            out = engine.generate([history[c]], GREEDY)[0]
            history[c] += out.token_ids
            outputs.append(out.token_ids)
    return outputs


def test_size_to_blocks_and_bad_sizes(tiny_model):
    engine = _engine(tiny_model, 0.0)
    assert engine.kv.host is None and engine.host_kv_cache is None and engine.stats().host_num_blocks == 0
    assert engine.snapshot() == (0, [])
    assert num_host_blocks(engine.kv_cache, 1e-9) == 1
    assert num_host_blocks(engine.kv_cache, 1.0) == (1 << 30) // engine.kv_cache.bytes_per_block
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        EngineConfig(model=str(tiny_model), kv_offloading_size=-1)


def test_colocated_greedy_identical_with_host_hits(tiny_model):
    plain, tiered = _engine(tiny_model, 0.0), _engine(tiny_model, TIER_GIB)
    assert _chat(tiered) == _chat(plain)
    stats = tiered.stats()
    assert stats.host_stored_blocks > 0 and stats.host_loaded_blocks > 0 and stats.host_loads > 0
    assert stats.host_hit_tokens == stats.host_loaded_blocks * BS
    # Later turns' histories came back from host memory: fewer prompt tokens computed.
    assert stats.num_computed_prompt_tokens < plain.stats().num_computed_prompt_tokens
    assert stats.num_prefix_hit_tokens > plain.stats().num_prefix_hit_tokens
    assert 0 < stats.host_num_used_blocks <= stats.host_num_blocks
    assert_baseline(tiered)
    seq, device_hashes, host_hashes = tiered.snapshot()
    assert seq == tiered.kv.events.seq and len(host_hashes) == stats.host_num_used_blocks


def test_host_tier_is_a_hard_bound_with_lru(tiny_model):
    tiny_tier = 4.5 * _engine(tiny_model, 0.0).kv_cache.bytes_per_block / (1 << 30)  # 4 blocks
    plain, tiered = _engine(tiny_model, 0.0), _engine(tiny_model, tiny_tier)
    assert tiered.kv.host.num_blocks == 4
    assert _chat(tiered) == _chat(plain)
    stats = tiered.stats()
    assert stats.host_num_used_blocks == 4 and stats.host_evicted_blocks > 0
    assert tiered.host_kv_cache.nbytes == 4 * tiered.kv_cache.bytes_per_block
    assert_baseline(tiered)


def test_handoff_loads_host_hits_on_both_pools(tiny_model):
    """Prefill serves a host hit for decode's hand-off by loading it; decode loads its own host
    blocks into the reservation, so fewer blocks cross the wire."""
    reference = _engine(tiny_model, 0.0, num_kv_blocks=64)
    prefill, decode = _engine(tiny_model, TIER_GIB), _engine(tiny_model, TIER_GIB)
    history = {c: list(SYSTEM) for c in range(4)}
    received = []
    for turn in range(3):
        for c in range(4):
            history[c] += _turn(c, turn)
            rid = f"c{c}t{turn}"
            first, indices = hand_off(prefill, decode, history[c], GREEDY, rid)
            received.append(len(indices))
            outputs: dict[str, list[RequestOutput]] = {rid: [first]}
            finish_all(decode, outputs)
            tokens = outputs[rid][-1].token_ids
            assert tokens == reference.generate([history[c]], GREEDY)[0].token_ids
            history[c] += tokens
    for engine in (prefill, decode):
        stats = engine.stats()
        assert stats.host_loaded_blocks > 0, "no host hit was served"
        assert_baseline(engine)
    # Decode's later turns received only what neither of its tiers held.
    assert max(received[4:]) < max(len(h) for h in history.values()) // BS


def _evict(engine: LLMEngine) -> None:
    """Fill the device pool with an unrelated prompt: every cached block moves to host memory."""
    engine.generate([[(13 * i) % 300 + 100 for i in range(185)]], SamplingParams(max_tokens=1))


def test_aborts_after_loads_and_abort_all_return_to_baseline(tiny_model):
    engine = _engine(tiny_model, TIER_GIB)
    history = list(SYSTEM) + _turn(0, 0)
    engine.generate([history], GREEDY)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    cases = [("running", "abort"), ("reserved", "release_reservation"), ("reserved-abort", "abort"), ("all", None)]
    for n, (rid, release) in enumerate(cases):
        _evict(engine)
        loaded = engine.stats().host_loaded_blocks
        if rid.startswith("reserved"):
            assert engine.reserve_prompt_blocks(engine.make_sequence(None, history + [n], long, rid)) is not None
        else:
            engine.add_request(prompt_token_ids=history + [n], params=long, request_id=rid)
            engine.step()  # admitted: its history loaded back, its first chunk computed
        assert engine.stats().host_loaded_blocks == loaded + 2, rid
        if release is not None:
            getattr(engine, release)(rid)
        else:
            assert engine.abort_all() == [rid]
        assert_baseline(engine)
