"""Aliases and the cascade over two real models (two in-process clusters in one Ray session,
each its own pools): a trained tiny model as the small one, a differently trained tiny model
(same tokenizer) as the large one. The cascade escalates exactly when the small model's own
confidence is below the threshold, on prompts in its training distribution (corpus text) and
out of it (random tokens); streamed text is only the answering model's; every block is freed."""

from __future__ import annotations

import math
import random

import httpx
import pytest

from splitserve.cluster.frontend.backend import ServingBackend
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.model_router.cascade_binding import confidence_of
from splitserve.cluster.frontend.model_router.model_route_decision import MODEL_HEADER, REASON_HEADER
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.model_route_set import build_model_routes
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.serving_api import ChoiceRequest
from splitserve.cluster.model_route_config import ModelRouteConfig
from splitserve.engine.builtin_models.corpus import PASSAGES
from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.proto import load_stubs
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import LoopHttpServer, cluster_config, grpc_stub, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]
pb2, _ = load_stubs()
WINDOW = 6
MAX_TOKENS = 12
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS)


# The small model: the 1-layer `draft` preset trained 300 steps (about 20 s of CPU, once per
# machine: the model cache) has memorised the corpus passages' openings. The large one: the
# same shape, untrained (another seed), so its answers differ from the small model's.
SMALL_SPEC = ModelSpec("draft", "llama", seed=0, train_steps=300)
LARGE_SPEC = ModelSpec("draft", "llama", seed=1)
IN_DISTRIBUTION = (1, 4, 9, 10)  # passages whose opening the small model continues confidently


@pytest.fixture(scope="module")
def served(ray_cluster, models_root, loop):
    """small / large: two real ServingBackends, each with its own in-process controller and pools."""
    backends = {}
    try:
        for name, spec in (("small", SMALL_SPEC), ("large", LARGE_SPEC)):
            root = None if spec.train_steps else models_root  # the trained one from the shared cache
            model_dir = str(cached_checkpoint(spec, root=root).path)
            prefill = 1 if name == "small" else 0  # the small model's blocks in both pools
            cfg = cluster_config(model_dir, num_prefill=prefill, num_blocks=256, served_model_name=name)
            backends[name] = ServingBackend(cfg, model_dir)
            loop.run(backends[name].start(), timeout=240)
        yield backends
    finally:
        for backend in backends.values():
            loop.run(backend.shutdown(), timeout=60)


def prompts(tokenizer) -> dict[str, list[int]]:
    """In distribution: the opening words of corpus passages; out: random token ids."""
    rng = random.Random(3)
    inside = {f"in{i}": tokenizer.encode(" ".join(PASSAGES[p].split()[:12])) for i, p in enumerate(IN_DISTRIBUTION)}
    outside = {f"out{i}": [rng.randrange(3, tokenizer.vocab_size) for _ in range(12)] for i in range(4)}
    return inside | outside


async def collect(api, prompt, params) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    async for chunk in api.generate(ChoiceRequest(prompt, params)):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
    return tokens, logprobs


@pytest.fixture(scope="module")
def measured(served, loop):
    """Per prompt: the small model's confidence over WINDOW greedy tokens, and each model's own
    greedy answer (token ids) when it serves the prompt alone."""
    out = {}
    for key, prompt in prompts(served["small"].tokenizer).items():
        small_tokens, logprobs = loop.run(collect(served["small"], prompt, SamplingParams(logprobs=True, **GREEDY)))
        large_tokens, _ = loop.run(collect(served["large"], prompt, SamplingParams(**GREEDY)))
        out[key] = (prompt, confidence_of(logprobs, WINDOW), small_tokens, large_tokens)
    return out


def cascade(served, threshold: float, metrics=None):
    route = {
        "name": "auto",
        "policy": "cascade",
        "cascade": {"small": "small", "large": "large", "window_tokens": WINDOW, "threshold": threshold},
    }
    return build_model_routes({}, [ModelRouteConfig.model_validate(route)], served, metrics or ModelRouteMetrics())[
        "auto"
    ]


def test_the_small_model_is_confident_in_distribution_and_not_out_of_it(measured):
    inside = [conf for key, (_, conf, _, _) in measured.items() if key.startswith("in")]
    outside = [conf for key, (_, conf, _, _) in measured.items() if key.startswith("out")]
    assert min(inside) > max(outside), (inside, outside)


def test_the_cascade_escalates_exactly_below_the_threshold_and_streams_only_the_answer(served, measured, loop):
    inside = min(conf for key, (_, conf, _, _) in measured.items() if key.startswith("in"))
    outside = max(conf for key, (_, conf, _, _) in measured.items() if key.startswith("out"))
    threshold = (inside + outside) / 2
    metrics = ModelRouteMetrics()
    route = cascade(served, threshold, metrics)
    tokenizer = served["small"].tokenizer
    with LoopHttpServer(loop, build_http_app(route)) as server:
        for key, (prompt, conf, small_tokens, large_tokens) in measured.items():
            body = {"model": "auto", "prompt": prompt, "stream": True, **GREEDY}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
                assert resp.status_code == 200
                # Every text event as it arrives: the client never sees anything it must discard.
                texts = [
                    event["choices"][0]["text"]
                    for line in resp.iter_lines()
                    if line.startswith("data: {")
                    for event in [httpx.Response(200, content=line[6:]).json()]
                    if event["choices"]
                ]
            escalated = conf < threshold
            assert resp.headers[REASON_HEADER] == ("escalated" if escalated else "confident"), (key, conf, threshold)
            assert resp.headers[MODEL_HEADER] == ("large" if escalated else "small")
            assert "".join(texts) == tokenizer.decode(large_tokens if escalated else small_tokens), key
    expected = sum(conf < threshold for _, conf, _, _ in measured.values())
    assert metrics.escalations.labels("auto")._value.get() == expected == 4
    for backend in served.values():
        wait_for_baseline(loop, backend.cluster)  # the aborted small requests' blocks too


def test_the_threshold_boundary_is_exact(served, measured, loop):
    """At exactly the measured confidence the small model answers; a hair above, it escalates."""
    prompt, conf, small_tokens, large_tokens = measured["in0"]

    async def run(threshold):
        binding = cascade(served, threshold).bind(RequestFeatures(prompt, SamplingParams(**GREEDY)))
        tokens = []
        async for chunk in binding.generate(ChoiceRequest(prompt, SamplingParams(**GREEDY))):
            tokens += chunk.token_ids
        return binding.decision, tokens

    decision, tokens = loop.run(run(conf))
    assert (decision.reason, decision.confidence, tokens) == ("confident", conf, small_tokens)
    decision, tokens = loop.run(run(math.nextafter(conf, 1.0)))
    assert (decision.reason, decision.target, tokens) == ("escalated", "large", large_tokens)
    wait_for_baseline(loop, served["small"].cluster)


def test_a_weighted_alias_over_real_models_reports_who_answered_over_http_and_grpc(served, measured, loop):
    metrics = ModelRouteMetrics()
    alias = build_model_routes({"chat": {"small": 1, "large": 1}}, [], served, metrics, random.Random(11))["chat"]
    prompt, _, small_tokens, large_tokens = measured["in1"]
    own = {"small": small_tokens, "large": large_tokens}
    tokenizer = served["small"].tokenizer
    answered = []
    with LoopHttpServer(loop, build_http_app(alias)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for _ in range(10):
                resp = client.post("/v1/completions", json={"model": "chat", "prompt": prompt, **GREEDY})
                model = resp.json()["model"]
                assert resp.headers[MODEL_HEADER] == model
                assert resp.json()["choices"][0]["text"] == tokenizer.decode(own[model])  # that model's answer
                answered.append(model)
    assert set(answered) == {"small", "large"}
    with grpc_stub(loop, alias) as stub:
        call = stub.Generate(
            pb2.GenerateRequest(
                model="chat", token_ids=pb2.TokenIds(ids=prompt), max_tokens=MAX_TOKENS, temperature=0.0
            )
        )
        tokens = [t for response in call for t in response.token_ids]
        metadata = dict(call.initial_metadata())
    assert tokens == own[metadata[MODEL_HEADER]] and metadata[REASON_HEADER] == "weight"
    for backend in served.values():
        wait_for_baseline(loop, backend.cluster)
