"""The prefill -> decode handoff between real engines of different tensor-parallel sizes, without
Ray (bench/kv_transfer/tp_handoff.py: follower ranks are spawned processes running their KV data
plane; every transfer over real gloo pairs, rank to rank): for P/D of 1/1, 2/1, 1/2 and 2/2 the
greedy tokens equal the TP-1 engine's, log-probabilities within LOGPROB_TOL (the TP-2 sums
reduce in another order); layer-wise and packed; the bytes each side counts are the 1/1
figure; a decode-side prefix hit moves only the missing blocks; an int8 KV cache moves its
values and scales; and with one KV head replicated over two ranks on either side the tokens
hold, a prefill rank nobody draws from sends nothing, and each decode rank gets its copy.
Two gloo ranks on two shared cores: correctness only, no timing."""

from __future__ import annotations

import pytest

from splitserve.bench.kv_transfer.tp_handoff import Replica, handoff, pair
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import make_checkpoint

# One worker runs this file: its TP 1 and 2 replicas (the `replicas` fixture) start once.
pytestmark = pytest.mark.one_worker

# fp32; a TP-2 replica's row-parallel sums add the ranks' partial products in another order
# than one matmul, so log-probabilities may differ in the last bits, never by more than this.
LOGPROB_TOL = 1e-4
PROMPT = [5, 17, 33, 2, 9, 41, 77, 100, 3, 8, 12, 60, 61, 62, 70, 71, 72, 90, 91, 92]  # 20 tokens: 5 blocks of 4
MAX_TOKENS = 8
ENGINE = {"num_kv_blocks": 64, "block_size": 4}


def _reference(model: str, prompt: list[int], **engine) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    out = LLMEngine(EngineConfig(model=model, **ENGINE, **engine)).generate([prompt], params)[0]
    return out.token_ids, out.logprobs


def _assert_matches(got, reference) -> None:
    tokens, logprobs = reference
    assert got.token_ids == tokens
    assert max(abs(a - b) for a, b in zip(got.logprobs, logprobs)) <= LOGPROB_TOL


@pytest.fixture(scope="module")
def replicas(models_root):
    """Prefill and decode replicas of TP 1 and 2 of the tiny model (4 heads, 2 KV heads)."""
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    made = {name: Replica(name, model, int(name[-1]), **ENGINE) for name in ("p1", "p2", "d1", "d2")}
    try:
        for p in ("p1", "p2"):
            for d in ("d1", "d2"):
                pair(made[p], made[d])
        yield model, made
    finally:
        for replica in made.values():
            replica.close()


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "packed"])
def test_greedy_handoff_between_tp_sizes_equals_tp1_and_moves_the_1_1_bytes(replicas, layerwise):
    model, made = replicas
    reference = _reference(model, PROMPT)
    moved = {}
    for p, d in (("p1", "d1"), ("p2", "d1"), ("p1", "d2"), ("p2", "d2")):
        prompt = [300 + 10 * layerwise + len(moved)] + PROMPT  # a fresh first block: no prefix hit
        result = handoff(made[p], made[d], prompt, MAX_TOKENS, layerwise)
        _assert_matches(result, _reference(model, prompt))
        assert result.cached_blocks == 0
        moved[p, d] = (result.bytes_sent, result.bytes_received)
    one_one = made["d1"].engine.kv_cache.bytes_per_block * 6  # 21 tokens: 6 blocks
    assert set(moved.values()) == {(one_one, one_one)}, moved
    assert reference[0]  # the reference ran


def test_a_decode_side_prefix_hit_moves_only_the_missing_blocks_under_heterogeneous_tp(replicas):
    model, made = replicas
    for p, d in (("p2", "d1"), ("p1", "d2")):
        head = [400 + int(p[-1]) * 10 + int(d[-1])] + PROMPT[1:12]  # 12 tokens: 3 whole blocks
        first = handoff(made[p], made[d], head, MAX_TOKENS, True)  # decode now caches its blocks
        _assert_matches(first, _reference(model, head))
        prompt = head + [44, 45, 46, 47, 48, 49]  # 18 tokens: 5 blocks, the first 3 cached on decode
        result = handoff(made[p], made[d], prompt, MAX_TOKENS, True)
        _assert_matches(result, _reference(model, prompt))
        assert result.cached_blocks == 3 and result.blocks_sent == 2
        per_block = made["d1"].engine.kv_cache.bytes_per_block  # the whole model's, on TP 1
        assert result.bytes_sent == result.bytes_received == 2 * per_block


def test_an_int8_kv_cache_moves_values_and_scales_between_tp_sizes(models_root):
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    engine = {**ENGINE, "kv_cache_dtype": "int8"}
    prefill, decode = Replica("p2i", model, 2, **engine), Replica("d1i", model, 1, **engine)
    try:
        pair(prefill, decode)
        for layerwise in (True, False):
            prompt = [450 + int(layerwise)] + PROMPT
            result = handoff(prefill, decode, prompt, MAX_TOKENS, layerwise)
            assert result.token_ids == _reference(model, prompt, kv_cache_dtype="int8")[0]
            assert result.bytes_received == result.bytes_sent == 6 * decode.engine.kv_cache.bytes_per_block
    finally:
        prefill.close()
        decode.close()


def test_one_kv_head_replicated_over_two_ranks_on_either_side(models_root):
    model = str(make_checkpoint(models_root, "draft", "llama"))  # 2 heads, 1 KV head
    made = {name: Replica(name, model, int(name[-1]), **ENGINE) for name in ("p1", "p2", "d1", "d2")}
    try:
        per_block = made["d1"].engine.kv_cache.bytes_per_block
        for p, d, copies in (("p2", "d1", 1), ("p1", "d2", 2), ("p2", "d2", 2)):
            pair(made[p], made[d])
            prompt = [480 + int(p[-1]) * 10 + int(d[-1])] + PROMPT + [7]
            result = handoff(made[p], made[d], prompt, MAX_TOKENS, True)
            _assert_matches(result, _reference(model, prompt))
            # Each decode rank keeps its own copy of the head; one prefill rank sends each.
            assert result.bytes_sent == result.bytes_received == 6 * per_block * copies
        # p2 -> d1: only prefill rank 0 sent (rank 1 holds the same head, nobody draws from it).
        stats = made["p2"].transport.rank_stats()
        assert stats[1].bytes_sent == 6 * per_block and stats[0].bytes_sent == 2 * 6 * per_block
    finally:
        for replica in made.values():
            replica.close()
