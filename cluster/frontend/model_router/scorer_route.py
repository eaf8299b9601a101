"""ScorerRoute: a virtual model whose RouteScorer decides: scored at or above the threshold,
the large model answers; below it, the small one."""

from __future__ import annotations

from splitserve.cluster.frontend.model_router.model_route_decision import ModelRouteDecision
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_binding import RouteBinding
from splitserve.cluster.frontend.model_router.route_scorer import RouteScorer, load_scorer
from splitserve.cluster.frontend.model_router.routed_model import RoutedModel
from splitserve.cluster.frontend.serving_api import ServingAPI
from splitserve.cluster.model_route_config import ModelRouteConfig


class ScorerRoute(RoutedModel):
    def __init__(
        self,
        config: ModelRouteConfig,
        targets: dict[str, ServingAPI],
        metrics: ModelRouteMetrics,
        scorer: RouteScorer | None = None,
    ):
        """scorer: an instance instead of the config's import path (tests, embedding)."""
        section = config.scorer
        assert section is not None  # ModelRouteConfig requires it for this policy
        super().__init__(config.name, {m: targets[m] for m in (section.small, section.large)}, metrics)
        self.small, self.large, self.threshold = section.small, section.large, section.threshold
        self.scorer = scorer or load_scorer(section.scorer, section.options)

    def pick(self, features: RequestFeatures) -> ModelRouteDecision:
        score = float(self.scorer.score(features, self.tokenizer.decode(features.prompt_token_ids)))
        if not 0 <= score <= 1:
            raise ValueError(f"scorer of route {self.name!r} returned {score!r}, not a number in [0, 1]")
        target = self.large if score >= self.threshold else self.small
        return ModelRouteDecision(self.name, target, "score", confidence=score)

    def bind(self, features: RequestFeatures) -> RouteBinding:
        decision = self.pick(features)
        return RouteBinding(self.targets[decision.target], decision, self.metrics)
