"""Aliases and virtual models behind the real HTTP app, over scripted backends (no Ray): the
weighted split and its tolerance, rules, the scorer interface, the cascade's decision and
streaming, and how the answering model is reported (model field, headers, metrics)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.model_router.cascade_binding import confidence_of
from splitserve.cluster.frontend.model_router.model_route_decision import MODEL_HEADER, REASON_HEADER
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.model_route_set import build_model_routes
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_scorer import RouteScorer, load_scorer
from splitserve.cluster.model_route_config import ModelRouteConfig
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.http_api import FakeBackend, parse_sse

# The fakes answer with logprob -0.25 * n at token n: over a 4-token window the confidence is
# exp(-(0.25 + 0.5 + 0.75 + 1.0) / 4) = exp(-0.625) ~ 0.535.
FAKE_CONFIDENCE = confidence_of([-0.25, -0.5, -0.75, -1.0], 4)


@pytest.fixture
def served(tokenizer):
    return {"small": FakeBackend(tokenizer), "large": FakeBackend(tokenizer)}


def routes(served, metrics, **extra):
    cfg = {
        "aliases": {"chat": {"small": 0.8, "large": 0.2}, "big": "large"},
        "routes": [
            ModelRouteConfig.model_validate(r)
            for r in extra.get(
                "routes",
                [
                    {
                        "name": "auto",
                        "policy": "cascade",
                        "cascade": {"small": "small", "large": "large", "window_tokens": 4},
                    }
                ],
            )
        ],
    }
    return build_model_routes(cfg["aliases"], cfg["routes"], served, metrics, random.Random(7))


def test_a_weighted_alias_splits_requests_by_weight_within_tolerance(served):
    alias = routes(served, ModelRouteMetrics())["chat"]
    features = RequestFeatures([1, 2, 3], SamplingParams())
    n = 10_000
    picks = Counter(alias.bind(features).decision.target for _ in range(n))
    # Binomial(10000, 0.2): sd = 40; the stated tolerance is 4 sd (+-1.6 points).
    assert abs(picks["large"] - 0.2 * n) <= 160, picks
    assert picks["small"] + picks["large"] == n


def test_the_answering_model_is_the_response_model_header_and_metric(served):
    metrics = ModelRouteMetrics()
    alias = routes(served, metrics)["chat"]
    with TestClient(build_http_app(alias), raise_server_exceptions=False) as client:
        answered = Counter()
        for _ in range(40):
            resp = client.post("/v1/completions", json={"model": "chat", "prompt": "Hello", "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            model = resp.json()["model"]
            assert resp.headers[MODEL_HEADER] == model and resp.headers[REASON_HEADER] == "weight"
            answered[model] += 1
        resp = client.post(
            "/v1/chat/completions",
            json={"model": "chat", "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        )
        events = [e for e in parse_sse(resp.text) if isinstance(e, dict)]
        assert {e["model"] for e in events} == {resp.headers[MODEL_HEADER]}
        answered[resp.headers[MODEL_HEADER]] += 1
    # Each backend generated exactly the requests reported as its own.
    assert {m: len(served[m].calls) for m in ("small", "large")} == {m: answered[m] for m in ("small", "large")}
    text = generate_latest(metrics.registry).decode()
    for model in ("small", "large"):
        line = f'splitserve_model_route_decisions_total{{reason="weight",route="chat",target="{model}"}} {answered[model]:.1f}'
        assert line in text, text


def test_rules_pick_by_header_length_max_tokens_and_structured_output(served):
    rules = [
        {"target": "large", "header": "x-tier", "header_value": "gold"},
        {"target": "large", "min_prompt_tokens": 20},
        {"target": "large", "min_max_tokens": 100},
        {"target": "large", "structured_output": True},
    ]
    route = routes(
        served, ModelRouteMetrics(), routes=[{"name": "auto", "policy": "rules", "default": "small", "rules": rules}]
    )["auto"]
    with TestClient(build_http_app(route), raise_server_exceptions=False) as client:

        def ask(headers=None, **body):
            resp = client.post(
                "/v1/completions",
                headers=headers or {},
                json={"model": "auto", "prompt": "Hi", "max_tokens": 2, **body},
            )
            assert resp.status_code == 200, resp.text
            return resp.json()["model"], resp.headers[REASON_HEADER]

        assert ask() == ("small", "default")
        assert ask({"X-Tier": "gold"}) == ("large", "rule:0")
        assert ask({"X-Tier": "silver"}) == ("small", "default")
        assert ask(prompt="word " * 30) == ("large", "rule:1")
        assert ask(max_tokens=150) == ("large", "rule:2")
        assert ask(structured_outputs={"regex": "[ab]+"}) == ("large", "rule:3")


class PromptWordScorer(RouteScorer):
    """A scorer dropped in by import path: "hard" in the prompt needs the large model."""

    def __init__(self, word: str = "hard"):
        self.word = word

    def score(self, features, text):
        return 1.0 if self.word in text else 0.0


def test_a_scorer_is_loaded_by_import_path_and_decides(served):
    path = f"{__name__}:PromptWordScorer"
    route_cfg = {
        "name": "auto",
        "policy": "scorer",
        "scorer": {"scorer": path, "options": {"word": "tricky"}, "small": "small", "large": "large"},
    }
    route = routes(served, ModelRouteMetrics(), routes=[route_cfg])["auto"]
    assert route.pick(RequestFeatures(route.encode("a tricky one"), SamplingParams())).target == "large"
    assert route.pick(RequestFeatures(route.encode("an easy one"), SamplingParams())).target == "small"
    builtin = load_scorer("length", {"long_prompt_tokens": 10})
    assert builtin.score(RequestFeatures(list(range(20)), SamplingParams(max_tokens=1)), "") == pytest.approx(0.5)
    assert builtin.score(RequestFeatures([1], SamplingParams(max_tokens=1)), "explain why") > 0.5
    for bad, message in [
        ("nope", "expected `length`"),
        ("no.such.module:X", "cannot be imported"),
        ("random:Random", "not a RouteScorer"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_scorer(bad, {})


@pytest.mark.parametrize(("threshold", "escalated"), [(FAKE_CONFIDENCE, False), (FAKE_CONFIDENCE + 1e-9, True)])
def test_the_cascade_escalates_exactly_below_the_threshold_and_never_streams_retracted_text(
    served, threshold, escalated
):
    metrics = ModelRouteMetrics()
    cascade = {"small": "small", "large": "large", "window_tokens": 4, "threshold": threshold}
    route = routes(served, metrics, routes=[{"name": "auto", "policy": "cascade", "cascade": cascade}])["auto"]
    served["large"].reply_ids = route.encode(" Large answers differently.")
    with TestClient(build_http_app(route), raise_server_exceptions=False) as client:
        resp = client.post("/v1/completions", json={"model": "auto", "prompt": "Hi", "max_tokens": 8, "stream": True})
    assert resp.status_code == 200
    events = [e for e in parse_sse(resp.text) if isinstance(e, dict)]
    text = "".join(c["text"] for e in events for c in e["choices"])
    answering = served["large" if escalated else "small"]
    assert text == answering.expected_text(8)
    assert resp.headers[MODEL_HEADER] == ("large" if escalated else "small")
    assert resp.headers[REASON_HEADER] == ("escalated" if escalated else "confident")
    assert all(c.get("logprobs") is None for e in events for c in e["choices"])  # not asked: stripped
    small_call = served["small"].calls[0]
    assert small_call["params"].logprobs  # asked for internally
    if escalated:
        assert served["small"].closed_request_ids == [small_call["request_id"]]  # aborted after the window
        assert not served["large"].calls[0]["params"].logprobs  # the client's own params
    decisions = metrics.decisions.labels("auto", resp.headers[MODEL_HEADER], resp.headers[REASON_HEADER])
    assert decisions._value.get() == 1.0
    assert metrics.escalations.labels("auto")._value.get() == float(escalated)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"n": 2}, "direct:choices"),
        ({"prompt": ["a", "b"]}, "direct:choices"),
        ({"structured_outputs": {"regex": "[ab]+"}}, "direct:structured_output"),
    ],
)
def test_the_cascade_sends_what_it_cannot_judge_straight_to_the_large_model(served, body, reason):
    route = routes(served, ModelRouteMetrics())["auto"]
    with TestClient(build_http_app(route), raise_server_exceptions=False) as client:
        resp = client.post("/v1/completions", json={"model": "auto", "prompt": "Hi", "max_tokens": 2, **body})
    assert resp.status_code == 200, resp.text
    assert (resp.json()["model"], resp.headers[REASON_HEADER]) == ("large", reason)
    assert not served["small"].calls


def test_a_route_over_models_with_different_tokenizers_is_refused(served, tmp_path):
    from splitserve.engine.builtin_models.make_model import write_random_checkpoint
    from splitserve.engine.io.tokenizer import Tokenizer

    other = FakeBackend(Tokenizer.from_pretrained(write_random_checkpoint(tmp_path / "draft", preset="draft")))
    with pytest.raises(ValueError, match="models 'small' and 'other' have different tokenizers"):
        build_model_routes({"mix": {"small": 1, "other": 1}}, [], {**served, "other": other}, ModelRouteMetrics())


def test_rules_match_tenants_and_tools_and_every_set_condition():
    from splitserve.cluster.frontend.model_router.rules_route import matches
    from splitserve.cluster.model_route_config import RouteRule

    plain = RequestFeatures([1, 2, 3], SamplingParams(max_tokens=4))
    assert matches(RouteRule(target="m"), plain)  # no condition: matches anything
    team = RouteRule(target="m", tenants=["team-a"])
    assert matches(team, RequestFeatures([1], SamplingParams(), tenant="team-a"))
    assert not matches(team, RequestFeatures([1], SamplingParams(), tenant="team-b")) and not matches(team, plain)
    tools = RouteRule(target="m", tools=True)
    assert matches(tools, RequestFeatures([1], SamplingParams(), tools=True)) and not matches(tools, plain)
    both = RouteRule(target="m", max_prompt_tokens=3, max_max_tokens=3)  # all must hold
    assert not matches(both, plain) and matches(both, RequestFeatures([1, 2, 3], SamplingParams(max_tokens=3)))
