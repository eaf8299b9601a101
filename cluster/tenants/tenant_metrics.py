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
        self.last_reload = Gauge(
            "splitserve_tenants_last_reload_timestamp_seconds",
            "When this ingress replica last read the tenants (at start-up or on a change) without an error.",
            registry=registry,
        )
        self.reload_errors = Counter(
            "splitserve_tenants_reload_errors",
            "Reloads of the tenants (a changed file, /admin/reload) that failed; the previous tenants stayed.",
            registry=registry,
        )
        self.sync_errors = Counter(
            "splitserve_tenant_sync_errors",
            "Failed tenant syncs with the state store, by stage (leases, usage), each retried next tick.",
            ["stage"],
            registry=registry,
        )
