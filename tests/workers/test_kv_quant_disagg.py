"""An fp8 KV cache through the disaggregated path on local Ray (CPU, gloo), real actors: greedy
output equals the colocated engine with the same KV dtype over remote prefill and over decode's
local prefill with a prefix-cache hit, as do prompt log-probabilities, and structured output
stays valid; the decode replica's transfer counters show the 8-bit
bytes (values + scales) moved; /health and /metrics show each pool's blocks and bytes per block
(sized by kv_cache_memory_bytes); blocks return to baseline."""

from __future__ import annotations

import asyncio
import json

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_sizing import kv_bytes_per_block
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline

pytestmark = pytest.mark.ray
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
BS = 16
NUM_BLOCKS = 80  # what the memory budget below buys


def prompts() -> list[list[int]]:
    return [[(5 * i + 3 * n) % 300 + 30 for i in range(n)] for n in (3, 16, 37, 64)]


@pytest.fixture(scope="module")
def per_block(tiny_model) -> int:
    return kv_bytes_per_block(ModelConfig.from_pretrained(tiny_model), BS, "fp8", None)


@pytest.fixture(scope="module")
def colocated(tiny_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128, kv_cache_dtype="fp8"))


@pytest.fixture(scope="module")
def reference(colocated):
    return lambda batch: [o.token_ids for o in colocated.generate(batch, GREEDY)]


@pytest.fixture(scope="module")
def serving(ray_cluster, tiny_model, loop, per_block):
    cfg = cluster_config(tiny_model, policy="kv")
    for pool in (cfg.prefill, cfg.decode):
        pool.kv_cache_dtype = "fp8"
        pool.kv_cache_memory_bytes = NUM_BLOCKS * per_block + per_block // 2
    with serving_backend(loop, cfg, tiny_model) as backend:
        yield backend


def decode_poll(serving) -> PollReply:
    return PollReply.from_bytes(ray.get(serving.cluster.decode_pool.get("decode-0").handle.poll.remote()))


def run_all(loop, cluster, batch):
    async def go():
        return await asyncio.gather(*(cluster.complete(p, GREEDY) for p in batch))

    return loop.run(go(), timeout=180)


def test_remote_prefill_matches_colocated_and_moves_8_bit_blocks(loop, serving, reference, per_block, tiny_model):
    before = decode_poll(serving).transfer
    results = run_all(loop, serving.cluster, prompts())
    assert [r["token_ids"] for r in results] == reference(prompts())
    assert all(r["prefill_replica"] == "prefill-0" for r in results)
    after = decode_poll(serving).transfer
    moved_blocks = after.num_blocks - before.num_blocks
    assert moved_blocks > 0 and after.num_bytes - before.num_bytes == moved_blocks * per_block
    bf16_block = kv_bytes_per_block(ModelConfig.from_pretrained(tiny_model), BS, "auto", "bfloat16")
    assert per_block / bf16_block <= 0.57  # head_dim 16: (16 + 2) / 32
    wait_for_baseline(loop, serving.cluster)


def test_local_prefill_with_a_prefix_cache_hit_matches_colocated(loop, serving, reference):
    shared = [(11 * i) % 250 + 40 for i in range(3 * BS)]
    run_all(loop, serving.cluster, [shared + [1, 2, 3]])  # remote: decode now holds the 3 blocks
    cluster = serving.cluster
    cluster.router.config = cluster.router.config.model_copy(update={"local_prefill_threshold": 10**6})
    try:
        hits_before = decode_poll(serving).engine.num_prefix_hit_tokens
        prompt = shared + [7, 8, 9, 10, 11]
        (result,) = run_all(loop, cluster, [prompt])
        assert result["prefill_replica"] != "prefill-0"  # decode prefilled it itself
        assert decode_poll(serving).engine.num_prefix_hit_tokens - hits_before == 3 * BS
        assert result["token_ids"] == reference([prompt])[0]
    finally:
        cluster.router.config = cluster.router.config.model_copy(update={"local_prefill_threshold": 0})
    wait_for_baseline(loop, cluster)


def test_prompt_logprobs_and_structured_output_over_both_prefill_paths(loop, serving, colocated):
    from splitserve.proto.messages.grammar_spec import GrammarSpec

    cluster = serving.cluster
    prompt = [(13 * i) % 200 + 50 for i in range(40)]
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    expected = colocated.generate([prompt], scoring)[0].prompt_logprobs
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(structured_output=GrammarSpec.json_schema(schema), max_tokens=40, temperature=0)

    async def prompt_logprobs() -> list[float]:
        got = []
        async for chunk in cluster.generate(prompt, scoring):
            got.extend(chunk.prompt_logprobs)
        return got

    for threshold in (0, 10**6):  # remote prefill, then decode's local prefill
        cluster.router.config = cluster.router.config.model_copy(update={"local_prefill_threshold": threshold})
        try:
            got = loop.run(prompt_logprobs(), timeout=120)
            assert len(got) == len(expected) and max(abs(a - b) for a, b in zip(got, expected)) < 1e-4
            result = loop.run(cluster.complete(colocated.tokenize("A JSON object:"), constrained), timeout=120)
            assert result["finish_reason"] == "stop" and isinstance(json.loads(result["text"])["n"], int)
        finally:
            cluster.router.config = cluster.router.config.model_copy(update={"local_prefill_threshold": 0})
    wait_for_baseline(loop, cluster)


def test_health_and_metrics_show_blocks_and_bytes_per_block(loop, serving, per_block):
    health = serving.health()
    for pool in ("prefill", "decode"):
        assert health["pools"][pool]["kv_cache"] == {
            "kv_cache_dtype": "fp8",
            "num_blocks": NUM_BLOCKS,
            "bytes_per_block": per_block,
            "bytes": NUM_BLOCKS * per_block,
        }
    text = loop.run(serving.cluster.render_metrics(b""), timeout=30).decode()
    samples = {
        (s.name, s.labels.get("replica")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("splitserve_kv_cache_")
    }
    for replica in ("prefill-0", "decode-0"):
        assert samples[("splitserve_kv_cache_blocks", replica)] == NUM_BLOCKS
        assert samples[("splitserve_kv_cache_block_bytes", replica)] == per_block
