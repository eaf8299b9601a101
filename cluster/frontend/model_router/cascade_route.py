"""CascadeRoute: a virtual model that answers with the small model unless the small model's
own confidence over its first tokens is below the threshold (CascadeBinding has the streaming
rules). Requests a cascade cannot judge fairly go straight to the large model, named in the
decision's reason: several choices (n > 1 or several prompts: one answer per choice would
each need its own decision, and a mixed response), a structured-output constraint (the
grammar mask, not the model, shapes the probabilities), and tools (tool calls are the hard
work the large model is for)."""

from __future__ import annotations

from splitserve.cluster.frontend.model_router.cascade_binding import CascadeBinding
from splitserve.cluster.frontend.model_router.model_route_decision import ModelRouteDecision
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_binding import RouteBinding
from splitserve.cluster.frontend.model_router.routed_model import RoutedModel
from splitserve.cluster.frontend.serving_api import ServingAPI
from splitserve.cluster.model_route_config import ModelRouteConfig


class CascadeRoute(RoutedModel):
    def __init__(self, config: ModelRouteConfig, targets: dict[str, ServingAPI], metrics: ModelRouteMetrics):
        section = config.cascade
        assert section is not None  # ModelRouteConfig requires it for this policy
        super().__init__(config.name, {m: targets[m] for m in (section.small, section.large)}, metrics)
        self.small, self.large = section.small, section.large
        self.window_tokens, self.threshold = section.window_tokens, section.threshold

    def direct_reason(self, features: RequestFeatures) -> str | None:
        """Why the request skips the small model, or None when it cascades."""
        if features.choices > 1:
            return "direct:choices"
        # Tools first: declaring tools also sets a grammar (the tool-call format), so a request
        # with tools is a tools request, whatever else it constrains.
        if features.tools:
            return "direct:tools"
        if features.structured_output:
            return "direct:structured_output"
        return None

    def bind(self, features: RequestFeatures) -> RouteBinding | CascadeBinding:
        reason = self.direct_reason(features)
        if reason is not None:
            decision = ModelRouteDecision(self.name, self.large, reason)
            return RouteBinding(self.targets[self.large], decision, self.metrics)
        return CascadeBinding(
            self.name,
            (self.small, self.targets[self.small]),
            (self.large, self.targets[self.large]),
            self.window_tokens,
            self.threshold,
            self.metrics,
        )
