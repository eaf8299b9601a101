"""Usage metering and budgets through the TenantGate on SQLite and a real Postgres: settled
usage (n > 1 counting each prompt once, cached tokens at their weight, errors) is read back
exactly; after a restart (a new gate, a new engine, the same store) the budget already spent
still holds and the usage is intact."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.state.database import open_state_engine
from splitserve.cluster.tenants.tenant_gate import TenantGate
from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal

T0 = 1_800_000_000.0


def make_gate(state_url: str, holder: str, clock) -> TenantGate:
    cfg = ServeConfig(
        tenants=[
            {"name": "acme", "api_keys": ["sk-acme"], "budget_tokens": 1000, "cached_token_weight": 0.5},
            {"name": "other", "api_keys": ["sk-other"], "models": ["m"]},
        ]
    )
    return TenantGate(cfg, open_state_engine(state_url), holder, TenantMetrics(CollectorRegistry()), clock)


def test_usage_and_budget_survive_a_restart(state_url):
    now = [T0]
    gate = make_gate(state_url, "ingress-a", lambda: now[0])

    async def first_life():
        ticket = await gate.admit("sk-acme", "m", prompt_tokens=100, max_tokens=2 * 50)  # n = 2
        parts = [ticket.part(0), ticket.part(0)]
        for part in parts:
            part.started()
        ticket.close()  # the response is over; the generations end after it
        parts[0].finished(cached=40, completion=50, failed=False)
        parts[1].finished(cached=40, completion=30, failed=False)
        failed = await gate.admit("sk-acme", "m", prompt_tokens=10, max_tokens=100)
        part = failed.part(0)
        part.started()
        part.finished(cached=0, completion=5, failed=True)
        failed.close()
        with pytest.raises(TenantRefusal) as refused:
            await gate.admit("sk-other", "not-m", 1, 1)
        assert refused.value.status == 404 and refused.value.code == "model_not_found"
        with pytest.raises(TenantRefusal) as refused:
            await gate.admit("sk-acme", "m", 100, 900)  # 1000 > the 825 left (below)
        assert refused.value.code == "insufficient_quota"
        await gate.close()

    asyncio.run(first_life())
    rows = gate.usage_store.query("acme", None, None)
    assert rows == [
        {
            "tenant": "acme",
            "model": "m",
            "requests": 2,
            "errors": 1,
            "prompt_tokens": 110,
            "cached_tokens": 40,
            "completion_tokens": 85,
        }
    ]
    gate.usage_store.engine.dispose()
    # Spent: 100 - 40 * 0.5 + 80 = 160, then 10 + 5 = 15: 825 of the 1000 are left.
    restarted = make_gate(state_url, "ingress-b", lambda: now[0])

    async def second_life():
        with pytest.raises(TenantRefusal):
            await restarted.admit("sk-acme", "m", 26, 800)
        ticket = await restarted.admit("sk-acme", "m", 25, 800)
        assert restarted.limiter.remaining(ticket.tenant, "budget")[0] == 0
        await restarted.close()

    asyncio.run(second_life())
    assert restarted.usage_store.query(None, None, None)[0]["requests"] == 2  # intact; in flight not yet counted
    assert restarted.usage_store.query("acme", int(T0) + 3600, None) == []
    restarted.usage_store.engine.dispose()
