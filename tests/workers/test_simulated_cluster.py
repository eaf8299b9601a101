"""A simulated 1P+1D cluster (engine: simulated) behind the real OpenAI HTTP app: the official
`openai` client is served end to end; the handoff runs (blocks reserved, "sent" over the timed
link, acknowledged); prefix hits show as cached_tokens; KV events reach the router's index; a
replica added later becomes routable and drains away; every block comes back; the pools are
torch-free and hold no weights."""

from __future__ import annotations

import openai
import pytest

from splitserve.cluster.control.worker_pool import named_actors
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.engine.core.block_hash import hash_blocks
from tests.helpers.cluster import (
    cluster_config,
    pool_states,
    serving_backend,
    wait_for_baseline,
    wait_until,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
SIMULATED = {"engine": "simulated", "engine_profile": "llama-8b-h200"}
KV_BYTES_PER_BLOCK = 131072 * 16  # the profile's KV bytes per token x block_size
PROMPT = "The simulated engine keeps every part of the replica but the forward pass. " * 4


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    cfg = cluster_config(tiny_model, num_blocks=64, **SIMULATED)
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


def test_openai_requests_are_served_with_prefix_hits(loop, client, backend):
    cluster = backend.cluster
    first = client.completions.create(model=backend.model_name, prompt=PROMPT, max_tokens=12)
    assert first.usage.completion_tokens == 12 and first.choices[0].finish_reason == "length"
    prompt_ids = backend.tokenizer.encode(PROMPT)
    full_blocks = len(prompt_ids) // 16
    hashes = hash_blocks(prompt_ids, 16)[:full_blocks]
    # The prefill replica's KV events reach the router's index (through the ingress's poll).
    wait_until(
        lambda: max(cluster.router.index(PREFILL).prefix_match(hashes).values(), default=0) == full_blocks,
        None,
        "not indexed",
    )
    again = client.completions.create(model=backend.model_name, prompt=PROMPT, max_tokens=12)
    assert again.choices[0].text == first.choices[0].text  # deterministic per prompt
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks * 16
    stream = client.chat.completions.create(
        model=backend.model_name,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 7
    states = wait_for_baseline(loop, cluster)
    prefill = next(s for rid, s in states.items() if rid.startswith(PREFILL))
    decode = next(s for rid, s in states.items() if rid.startswith(DECODE))
    # The handoff ran: what prefill sent is what decode received, sized by the profile.
    assert decode.transfer.num_blocks == prefill.transfer.num_blocks > 0
    assert decode.transfer.num_bytes == prefill.transfer.num_bytes == prefill.transfer.num_blocks * KV_BYTES_PER_BLOCK


def test_stop_tokens_and_unsimulated_features(client, backend):
    base = client.completions.create(model=backend.model_name, prompt="stop here", max_tokens=8, logprobs=1)
    tokens = base.choices[0].logprobs.tokens
    assert len(tokens) == 8
    stop_id = backend.tokenizer.encode(tokens[2], add_special_tokens=False)
    stopped = client.completions.create(
        model=backend.model_name, prompt="stop here", max_tokens=8, extra_body={"stop_token_ids": stop_id[:1]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError, match="not simulated"):
        client.completions.create(
            model=backend.model_name,
            prompt="json please",
            max_tokens=8,
            extra_body={"response_format": {"type": "json_object"}},
        )


def test_a_new_replica_becomes_routable_then_drains_away(loop, client, backend):
    cluster = backend.cluster
    [replica] = loop.run(cluster.add_replicas(DECODE, 1), timeout=120)
    rid = replica.replica_id
    assert rid in cluster.router.replica_ids(DECODE)
    for i in range(4):
        out = client.completions.create(model=backend.model_name, prompt=f"request {i} " * 5, max_tokens=4)
        assert out.usage.completion_tokens == 4
    assert loop.run(cluster.drain_replica(DECODE, rid, 60), timeout=90) is True
    assert rid not in cluster.router.replica_ids(DECODE)
    assert rid not in named_actors(cluster.controller.namespace)
    wait_for_baseline(loop, cluster)


def test_the_replicas_never_import_torch(loop, backend):
    import ray

    cluster = backend.cluster

    def no_torch() -> bool:
        import sys

        return "torch" not in sys.modules

    for pool in (cluster.prefill_pool, cluster.decode_pool):
        for replica in pool.live_replicas():
            node = ray.get(replica.handle.__ray_call__.remote(lambda self: no_torch()))
            assert node, f"{replica.replica_id} imported torch"
    assert pool_states(loop, cluster)
