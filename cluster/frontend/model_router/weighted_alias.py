"""WeightedAlias: a served name that points at one model, or splits requests between several
by weight (canary, A/B). Each request (all its choices) goes to one model, drawn with
probability weight / sum(weights); the rng is injectable so tests can seed it."""

from __future__ import annotations

import random

from splitserve.cluster.frontend.model_router.model_route_decision import ModelRouteDecision
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_binding import RouteBinding
from splitserve.cluster.frontend.model_router.routed_model import RoutedModel
from splitserve.cluster.frontend.serving_api import ServingAPI


class WeightedAlias(RoutedModel):
    def __init__(
        self,
        name: str,
        weights: dict[str, float],
        targets: dict[str, ServingAPI],
        metrics: ModelRouteMetrics,
        rng: random.Random | None = None,
    ):
        """weights: served model id -> weight (> 0); targets: at least those models' APIs."""
        super().__init__(name, {model: targets[model] for model in weights}, metrics)
        self.models = list(weights)
        self.weights = [float(weights[m]) for m in self.models]
        self.rng = rng or random.Random()
        self.reason = "alias" if len(self.models) == 1 else "weight"

    def bind(self, features: RequestFeatures) -> RouteBinding:
        model = self.rng.choices(self.models, self.weights)[0]
        return RouteBinding(self.targets[model], ModelRouteDecision(self.name, model, self.reason), self.metrics)
