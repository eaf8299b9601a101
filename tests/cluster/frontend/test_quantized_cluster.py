"""A quantized model (--quantization int8) served end to end by a real 1P+1D cluster (local Ray,
CPU, gloo) through the unmodified `openai` client: both pools load the quantized weights, and
greedy output over the prefill replica and over decode's local prefill, with n-gram speculative
decoding in the decode pool and a warm prefix cache, equals the colocated engine's (what
`splitserve generate --quantization int8` runs); prompt logprobs (echo) equal the quantized
engine's; a regex-constrained output matches; the block pools return to baseline."""

from __future__ import annotations

import re

import openai
import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
SCHEME = "int8"
PROMPT = [(37 * i) % 500 + 5 for i in range(40)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    cfg = cluster_config(tiny_model, num_blocks=64, quantization=SCHEME, speculative={"method": "ngram"})
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def client(server):
    """An OpenAI client of the real cluster's server (this package's conftest `client` is a
    TestClient on a fake backend)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(tiny_model):
    """The colocated engine with the same quantization: greedy tokens and prompt logprobs."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
    quantized = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=64, quantization=SCHEME))
    full = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=64))
    out, full_out = (engine.generate([PROMPT], params)[0] for engine in (quantized, full))
    # They part after a dozen tokens: a pool that ignored the setting could not pass.
    assert out.token_ids != full_out.token_ids
    return out


def local_prefill(cluster, on: bool) -> None:
    cluster.router.config = cluster.router.config.model_copy(update={"local_prefill_threshold": 10**6 if on else 0})


@pytest.mark.parametrize("path", ["prefill-pool", "local-prefill"])
def test_quantized_cluster_output_equals_the_quantized_engine(loop, client, backend, expected, path):
    engines = backend.cluster.prefill_pool.engine_config, backend.cluster.decode_pool.engine_config
    assert all(config["quantization"] == SCHEME for config in engines)
    local_prefill(backend.cluster, path == "local-prefill")
    try:
        for _ in range(2):  # the second request's prompt blocks are cached
            out = client.completions.create(
                model=backend.model_name,
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].text == expected.text
    finally:
        local_prefill(backend.cluster, False)
    wait_for_baseline(loop, backend.cluster)


def test_quantized_prompt_logprobs_and_structured_output(loop, client, backend, expected):
    echoed = client.completions.create(
        model=backend.model_name, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0, temperature=0
    )
    served = echoed.choices[0].logprobs.token_logprobs[1 : len(PROMPT)]
    assert max(abs(a - b) for a, b in zip(served, expected.prompt_logprobs, strict=True)) < 1e-4
    constrained = client.completions.create(
        model=backend.model_name,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{3,8}"}},
    )
    assert re.fullmatch("[a-z]{3,8}", constrained.choices[0].text)
    wait_for_baseline(loop, backend.cluster)
