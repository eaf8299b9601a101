"""ModelRouteMetrics: the splitserve_model_route_* counters and the decision's log line.

One per ingress registry (every alias and route of the replica shares it), so /metrics
merges them over the ingress replicas as it does the other frontend families."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from splitserve.cluster.frontend.model_router.model_route_decision import ModelRouteDecision

logger = logging.getLogger(__name__)


class ModelRouteMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.decisions = Counter(
            "splitserve_model_route_decisions",
            "Requests to an alias or virtual model, by the served model that answered and why",
            ["route", "target", "reason"],
            registry=self.registry,
        )
        self.escalations = Counter(
            "splitserve_model_route_escalations",
            "Cascade requests the small model started and the large model answered",
            ["route"],
            registry=self.registry,
        )

    def record(self, decision: ModelRouteDecision, label: str | None = None) -> None:
        self.decisions.labels(decision.route, decision.target, decision.reason).inc()
        if decision.escalated:
            self.escalations.labels(decision.route).inc()
        logger.info(
            "model route %s -> %s (%s)",
            decision.route,
            decision.target,
            decision.reason,
            extra={
                "route": decision.route,
                "route_target": decision.target,
                "route_reason": decision.reason,
                "route_confidence": decision.confidence,
                "request_label": label,
            },
        )
