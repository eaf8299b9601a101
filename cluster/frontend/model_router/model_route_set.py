"""build_model_routes: every alias and virtual model of a ServeConfig as RoutedModel objects,
over the served models' APIs; what the ingress registers in its model catalog next to them."""

from __future__ import annotations

import random
from typing import Any

from splitserve.cluster.frontend.model_router.adapter_target import AdapterTarget
from splitserve.cluster.frontend.model_router.cascade_route import CascadeRoute
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.routed_model import RoutedModel
from splitserve.cluster.frontend.model_router.rules_route import RulesRoute
from splitserve.cluster.frontend.model_router.scorer_route import ScorerRoute
from splitserve.cluster.frontend.model_router.weighted_alias import WeightedAlias
from splitserve.cluster.frontend.serving_api import ServingAPI
from splitserve.cluster.model_route_config import AliasTarget, ModelRouteConfig, alias_weights


def build_model_routes(
    aliases: dict[str, AliasTarget],
    routes: list[ModelRouteConfig],
    served: dict[str, ServingAPI],
    metrics: ModelRouteMetrics,
    rng: random.Random | None = None,
) -> dict[str, RoutedModel]:
    """name -> RoutedModel for cfg.aliases and cfg.model_routes. served: served model id (or
    LoRA adapter name) -> its ServingAPI (ServingBackend, AdapterTarget) in this ingress; metrics: one per ingress registry.
    ValueError (a startup error) when a scorer cannot be loaded or models differ in tokenizer."""
    built: dict[str, RoutedModel] = {}
    for name, target in aliases.items():
        built[name] = WeightedAlias(name, alias_weights(target), served, metrics, rng)
    kinds = {"rules": RulesRoute, "cascade": CascadeRoute, "scorer": ScorerRoute}
    for route in routes:
        built[route.name] = kinds[route.policy](route, served, metrics)
    return built


def register_model_routes(catalog: Any, cfg: Any, registry: Any) -> None:
    """Add cfg.aliases and cfg.model_routes to an ingress's catalog (after its served models),
    with one ModelRouteMetrics on the ingress's registry."""
    if not cfg.aliases and not cfg.model_routes:
        return
    served = {name: api for name, api in catalog.items()}
    for adapter in catalog.adapters():  # a LoRA adapter is a target too, on its base model
        served[adapter] = AdapterTarget(catalog.resolve(adapter), adapter)
    metrics = ModelRouteMetrics(registry)
    for name, routed in build_model_routes(cfg.aliases, cfg.model_routes, served, metrics).items():
        catalog.register(name, routed, routed=True)
