"""Two real models in one deployment (local Ray, CPU): one ModelControllers (a Controller per
model, as the controller deployment runs them) and, in front, one ServingBackend per model
sharing one admission, resolved by name in a ModelCatalog behind the real HTTP app (the
`openai` client) and the real gRPC frontend. Each model answers exactly as it does alone
(greedy, against an in-process engine on its checkpoint); /v1/models lists both; an unknown
model is 404 model_not_found / NOT_FOUND; a prompt cached under one model is never credited
to the other; the pools scale and fail independently; every pool returns to baseline."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.engine.core.block_hash import hash_blocks, root_hash
from splitserve.proto import load_stubs
from tests.helpers.cluster import cluster_config, wait_until
from tests.helpers.model import engine_reference, make_checkpoint
from tests.helpers.models_deployment import ModelsDeployment

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
pb2, pb2_grpc = load_stubs()
TIMEOUT_S = 120
PROMPT = list(range(40, 88))  # 3 full blocks of 16, valid in both vocabularies


@pytest.fixture(scope="module")
def models(ray_cluster, models_root, loop):
    alpha = str(make_checkpoint(models_root, "tiny", "llama"))
    beta = str(make_checkpoint(models_root, "draft", "qwen2"))
    cfg = cluster_config(
        alpha,
        policy="kv",
        num_blocks=64,
        models=[{"model": alpha, "served_model_name": "alpha"}, {"model": beta, "served_model_name": "beta"}],
    )
    deployment = ModelsDeployment(loop, cfg)
    try:
        yield deployment
    finally:
        deployment.close()


@pytest.fixture(scope="module")
def client(models):
    return openai.OpenAI(base_url=models.http.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def stub(models):
    with grpc.insecure_channel(f"127.0.0.1:{models.grpc_port}") as channel:
        yield pb2_grpc.SplitServeStub(channel)


def grpc_tokens(stub, model: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """(generated token ids, cached prompt tokens) of one greedy Generate call."""
    request = pb2.GenerateRequest(
        model=model, token_ids=pb2.TokenIds(ids=prompt), max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    responses = list(stub.Generate(request, timeout=TIMEOUT_S))
    cached = max(r.usage.cached_tokens for r in responses)
    return [t for r in responses for t in r.token_ids], cached


def test_each_model_answers_as_it_does_alone_over_http_and_grpc(models, client, stub):
    for name, backend in models.backends.items():
        expected = engine_reference(backend.model_dir)(PROMPT[:20], 8)
        tokens, _ = grpc_tokens(stub, name, PROMPT[:20], 8)
        assert tokens == expected, name
        answer = client.completions.create(model=name, prompt=PROMPT[:20], max_tokens=8, temperature=0)
        assert answer.model == name  # the name that answered
        assert answer.choices[0].text == backend.tokenizer.decode(expected)
    assert models.backends["alpha"].tokenizer.vocab_size != models.backends["beta"].tokenizer.vocab_size


def test_models_lists_both_and_an_unknown_model_is_not_found(models, client, stub):
    assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
    assert [m.id for m in stub.Models(pb2.ModelsRequest(), timeout=TIMEOUT_S).models] == ["alpha", "beta"]
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="gamma", prompt="hello", max_tokens=2)
    assert refused.value.code == "model_not_found" and refused.value.param == "model"
    with pytest.raises(grpc.RpcError) as not_found:
        grpc_tokens(stub, "gamma", PROMPT[:4], 2)
    assert not_found.value.code() == grpc.StatusCode.NOT_FOUND and "gamma" in not_found.value.details()
    schema = json.loads(client_get(models, "/openapi.json"))
    assert ["alpha", "beta"] in _enums(schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"])
    with pytest.raises(ValueError, match="already served"):
        models.catalog.register("beta", models.backends["alpha"])


def test_a_prompt_cached_under_one_model_is_never_credited_to_the_other(models, stub):
    prompt = [7] + PROMPT  # a prompt no other test sends
    alpha_router, beta_router = (models.backends[m].cluster.router for m in ("alpha", "beta"))
    grpc_tokens(stub, "alpha", prompt, 2)
    hashes = hash_blocks(prompt, 16, root_hash("alpha"))  # the chain alpha's engines and router use
    assert set(hashes).isdisjoint(hash_blocks(prompt, 16, root_hash("beta")))  # beta's never coincide
    wait_until(
        lambda: alpha_router.index(DECODE).holders(hashes[0]), None, "alpha's KV events never indexed the prompt"
    )
    assert not any(beta_router.index(pool).holders(h) for pool in (PREFILL, DECODE) for h in hashes)
    before = prefix_hits(models)
    _, cached = grpc_tokens(stub, "alpha", prompt, 2)
    assert cached >= 32  # alpha's own repeat hits its cache
    _, cached = grpc_tokens(stub, "beta", prompt, 2)
    assert cached == 0  # the same token ids under beta: nothing of alpha's is credited
    after = prefix_hits(models)
    assert after["alpha"] - before["alpha"] >= 32 and after["beta"] == before["beta"]
    wait_until(lambda: merged_hits(models) == after, None, "/metrics never showed both models' counts")
    models.baseline()


def prefix_hits(models) -> dict[str, float]:
    """splitserve_prefix_cache_hit_tokens_total by model_name, as each model's backend counts it
    now (the merged /metrics has other backends' samples as of their last report)."""
    return {
        s.labels["model_name"]: s.value
        for backend in models.backends.values()
        for family in text_string_to_metric_families(backend.metrics.render().decode())
        for s in family.samples
        if s.name == "splitserve_prefix_cache_hit_tokens_total"
    }


def merged_hits(models) -> dict[str, float]:
    """The same series from the deployment's merged /metrics (every model's, one view)."""
    return {
        s.labels["model_name"]: s.value
        for family in text_string_to_metric_families(client_get(models, "/metrics"))
        for s in family.samples
        if s.name == "splitserve_prefix_cache_hit_tokens_total"
    }


def client_get(models, path: str) -> str:
    import httpx

    return httpx.get(models.http.url + path, timeout=TIMEOUT_S).text


def _enums(node) -> list:
    """Every `enum` list inside a JSON-schema node."""
    if isinstance(node, dict):
        return ([node["enum"]] if "enum" in node else []) + [e for v in node.values() for e in _enums(v)]
    if isinstance(node, list):
        return [e for v in node for e in _enums(v)]
    return []


def test_pools_scale_independently(models, stub):
    alpha, beta = models.controllers.controllers["alpha"], models.controllers.controllers["beta"]
    loop = models.loop
    (added,) = loop.run(alpha.add_replicas(DECODE, 1), timeout=300)  # what alpha's autoscaler calls
    assert len(alpha.pools[DECODE].live_replicas()) == 2 and len(beta.pools[DECODE].live_replicas()) == 1
    wait_until(lambda: models.backends["alpha"].cluster.live_replicas(DECODE) == 2, None, "alpha's ingress missed it")
    assert models.backends["beta"].cluster.live_replicas(DECODE) == 1
    assert added.replica_id not in models.backends["beta"].cluster.router.replica_ids(DECODE)
    assert models.catalog.health()["models"]["alpha"]["pools"][DECODE]["live"] == 2
    assert grpc_tokens(stub, "beta", PROMPT[:20], 4)[0]  # beta serves on, untouched
    assert loop.run(alpha.drain_replica(DECODE, added.replica_id), timeout=180)
    wait_until(lambda: models.backends["alpha"].cluster.live_replicas(DECODE) == 1, None, "alpha did not scale back")
    models.baseline()


def test_killing_one_models_pools_leaves_the_other_serving(models, client, stub):
    alpha = models.controllers.controllers["alpha"]
    killed = [r for pool in alpha.pools.values() for r in pool.live_replicas()]
    for replica in killed:
        ray.kill(replica.handle, no_restart=True)
    expected = engine_reference(models.backends["beta"].model_dir)(PROMPT[:20], 6)
    for _ in range(3):  # beta's requests never touch alpha's dead replicas
        assert grpc_tokens(stub, "beta", PROMPT[:20], 6)[0] == expected
        answer = client.completions.create(model="beta", prompt=PROMPT[:20], max_tokens=6, temperature=0)
        assert answer.choices[0].text == models.backends["beta"].tokenizer.decode(expected)
    # alpha's controller replaces its own replicas; then alpha serves again, as before
    gone = {r.replica_id for r in killed}

    def alpha_back() -> bool:
        state = models.catalog.health()["models"]["alpha"]
        live = {r.replica_id for pool in alpha.pools.values() for r in pool.live_replicas()}
        return state["ok"] and not live & gone

    wait_until(alpha_back, None, "alpha's pools were not replaced", interval_s=0.5)
    reference = engine_reference(models.backends["alpha"].model_dir)(PROMPT[:20], 6)
    wait_until(lambda: _serves(stub, "alpha", reference), None, "alpha does not serve after its replacement")
    assert models.catalog.health()["ok"]
    models.baseline()


def _serves(stub, model: str, expected: list[int]) -> bool:
    try:
        return grpc_tokens(stub, model, PROMPT[:20], len(expected))[0] == expected
    except grpc.RpcError:  # the ingress still routes to a dead replica: retried by the caller
        return False
