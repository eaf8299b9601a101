"""A simulated decode pool of TP 2 (engine: simulated, llama-8b-h200's TP-2 figures) behind the
real HTTP app and the official openai client: its replica is a gang of two Ray rank actors on one
node, as a real TP-2 replica is (so a simulated deployment holds the GPUs a real one would), the
prefill -> decode handoff between TP 1 and TP 2 runs, the tokens are those of a TP-1 simulated
replica, and every block comes back."""

from __future__ import annotations

import openai
import pytest

from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_factory import build_engine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import LoopHttpServer, cluster_config, serving_backend, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
PROFILE = "llama-8b-h200"
PROMPT = "A simulated replica of two ranks steps by its profile's figures for two. " * 3


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    cfg = cluster_config(tiny_model, engine="simulated", engine_profile=PROFILE)
    cfg = cfg.model_copy(update={"decode": cfg.decode.model_copy(update={"tensor_parallel_size": 2})})
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


def test_a_simulated_tp2_decode_gang_serves_the_tp1_tokens(loop, backend, tiny_model):
    (replica,) = backend.cluster.decode_pool.live_replicas()
    assert replica.gang is not None and replica.gang.size == 2 and len(replica.gang.followers) == 1
    assert all(replica.gang.nodes) and len(set(replica.gang.nodes)) == 1
    reference = build_engine(EngineConfig(model=tiny_model, engine="simulated", profile=PROFILE))
    expected = reference.generate([reference.tokenize(PROMPT)], SamplingParams(max_tokens=12))[0].token_ids
    with LoopHttpServer(loop, build_http_app(backend)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model=backend.model_name, prompt=PROMPT, max_tokens=12, logprobs=1)
    assert out.usage.completion_tokens == 12
    assert out.choices[0].text == reference.tokenizer.decode(expected)
    states = wait_for_baseline(loop, backend.cluster)
    decode = next(s for rid, s in states.items() if rid.startswith("decode"))
    assert decode.transfer.num_blocks > 0  # the handoff from the TP-1 prefill replica ran
