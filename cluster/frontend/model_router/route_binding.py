"""RouteBinding: one request bound to the served model its route picked; bind_route(api, features)
is what the frontends call (a plain model's api binds to itself, without a decision)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from splitserve.cluster.frontend.model_router.model_route_decision import ModelRouteDecision
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.serving_api import ChoiceRequest, GenerationAPI
from splitserve.proto.messages.handoff import StreamChunk


class RouteBinding:
    """A request whose model is known before it starts (alias, rules, scorer, and the
    cascade's direct cases): every choice goes to `target`; the decision is recorded once."""

    def __init__(self, target: GenerationAPI, decision: ModelRouteDecision, metrics: ModelRouteMetrics):
        self.target = target
        self.decision: ModelRouteDecision | None = decision
        self.metrics = metrics
        self._recorded = False

    def generate(self, choice: ChoiceRequest) -> AsyncIterator[StreamChunk]:
        if not self._recorded and self.decision is not None:
            self._recorded = True
            self.metrics.record(self.decision, choice.label)
        return choice.metered(self.target.generate(choice.unmetered()))


def bind_route(api: Any, features: RequestFeatures) -> Any:
    """What to call generate on for one request: a routed model (alias, virtual model) binds
    the request to a served model; a served model is its own. Read decision_of(binding) after
    the first chunk: a cascade decides only then."""
    bind = getattr(api, "bind", None)
    return api if bind is None else bind(features)


def decision_of(binding: Any) -> ModelRouteDecision | None:
    """The binding's decision once made (after its first chunk), None for a served model."""
    return getattr(binding, "decision", None)
