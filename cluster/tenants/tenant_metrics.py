"""Per-tenant Prometheus series, labelled by the tenant's name (never a key)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "splitserve_tenant_requests",
            "Requests per tenant, by outcome (ok, error, or the refusal: rate_limited, over_budget, ...).",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "splitserve_tenant_tokens",
            "Settled tokens per tenant: prompt, cached (prompt tokens served from cache), completion.",
            ["tenant", "kind"],
            registry=registry,
        )
        self.budget_remaining = Gauge(
            "splitserve_tenant_budget_remaining",
            "Tokens left in the tenant's budget this period, as this ingress replica knows it.",
            ["tenant"],
            registry=registry,
        )
