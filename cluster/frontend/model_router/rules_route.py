"""RulesRoute: a virtual model whose first matching rule (prompt length, max_tokens, tenant,
a header, structured output, tools) picks the model; none matching: the default."""

from __future__ import annotations

from splitserve.cluster.frontend.model_router.model_route_decision import ModelRouteDecision
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_binding import RouteBinding
from splitserve.cluster.frontend.model_router.routed_model import RoutedModel
from splitserve.cluster.frontend.serving_api import ServingAPI
from splitserve.cluster.model_route_config import ModelRouteConfig, RouteRule


class RulesRoute(RoutedModel):
    def __init__(self, config: ModelRouteConfig, targets: dict[str, ServingAPI], metrics: ModelRouteMetrics):
        assert config.default is not None  # ModelRouteConfig requires it for rules
        models = dict.fromkeys([config.default, *(rule.target for rule in config.rules)])
        super().__init__(config.name, {model: targets[model] for model in models}, metrics)
        self.rules = list(config.rules)
        self.default = config.default

    def pick(self, features: RequestFeatures) -> ModelRouteDecision:
        for index, rule in enumerate(self.rules):
            if matches(rule, features):
                return ModelRouteDecision(self.name, rule.target, f"rule:{index}")
        return ModelRouteDecision(self.name, self.default, "default")

    def bind(self, features: RequestFeatures) -> RouteBinding:
        decision = self.pick(features)
        return RouteBinding(self.targets[decision.target], decision, self.metrics)


def matches(rule: RouteRule, features: RequestFeatures) -> bool:
    """Every condition the rule sets holds for the request."""
    n, max_tokens = features.prompt_tokens, features.params.max_tokens
    checks = (
        rule.min_prompt_tokens is None or n >= rule.min_prompt_tokens,
        rule.max_prompt_tokens is None or n <= rule.max_prompt_tokens,
        rule.min_max_tokens is None or max_tokens >= rule.min_max_tokens,
        rule.max_max_tokens is None or max_tokens <= rule.max_max_tokens,
        not rule.tenants or features.tenant in rule.tenants,
        rule.header is None
        or (rule.header in features.headers and rule.header_value in (None, features.headers[rule.header])),
        rule.structured_output is None or rule.structured_output == features.structured_output,
        rule.tools is None or rule.tools == features.tools,
    )
    return all(checks)
