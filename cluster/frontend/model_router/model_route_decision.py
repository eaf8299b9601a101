"""ModelRouteDecision: which served model answered a routed request, and why.

It reaches the client as the response's `model` field and the x-splitserve-model /
x-splitserve-route-reason headers (gRPC: initial metadata), the operator as a log line and
the splitserve_model_route_* metrics (ModelRouteMetrics)."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_HEADER = "x-splitserve-model"
REASON_HEADER = "x-splitserve-route-reason"


@dataclass
class ModelRouteDecision:
    route: str  # the alias or virtual model the client asked for
    target: str  # the served model that answers
    reason: str  # weight, rule:<i>, default, score, confident, escalated, direct:<why>
    confidence: float | None = None  # cascade: the small model's confidence; scorer: the score

    @property
    def escalated(self) -> bool:
        return self.reason == "escalated"

    def headers(self) -> dict[str, str]:
        return {MODEL_HEADER: self.target, REASON_HEADER: self.reason}
