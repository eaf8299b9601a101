"""Two real TenantLimiter instances (two ingress replicas) sharing one state store (SQLite and
a real Postgres): limits hold across both with no overshoot, Retry-After is honest, refunds
settle reservations, a lost replica's unused lease returns, a restart keeps the spent budget.
Time is a controlled clock, never slept on."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.exc import OperationalError

from splitserve.cluster.state.database import open_state_engine
from splitserve.cluster.tenants.sql_quota_authority import SqlQuotaAuthority
from splitserve.cluster.tenants.tenant_config import TenantConfig
from splitserve.cluster.tenants.tenant_limiter import TenantLimiter
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal

T0 = 1_800_000_000.0  # the start of a UTC minute (divisible by 60)


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def authority(state_url):
    engine = open_state_engine(state_url)
    yield SqlQuotaAuthority(engine)
    engine.dispose()


def tenant(**limits) -> TenantConfig:
    return TenantConfig(name=limits.pop("name", "acme"), api_keys=["k"], **limits)


async def admitted(limiter: TenantLimiter, t: TenantConfig, tokens: float = 0.0) -> bool:
    try:
        await limiter.admit(t, tokens)
        return True
    except TenantRefusal:
        return False


def test_requests_per_minute_hold_across_two_replicas_and_reset_is_honest(authority):
    clock = Clock()
    a = TenantLimiter(authority, "ingress-a", lease_fraction=0.1, clock=clock)
    b = TenantLimiter(authority, "ingress-b", lease_fraction=0.1, clock=clock)
    acme, other = tenant(requests_per_minute=50), tenant(name="other", requests_per_minute=5)

    async def run():
        results = [await admitted(a if i % 3 else b, acme) for i in range(80)]
        assert sum(results) == 50  # leases never sum past the limit: no overshoot at all
        for _ in range(5):  # the other tenant is unaffected
            assert await admitted(a, other)
        with pytest.raises(TenantRefusal) as refused:
            await a.admit(acme, 0)
        assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
        wait = refused.value.retry_after_s
        assert 0 < wait <= 60
        clock.now += wait - 0.5
        assert not await admitted(b, acme)  # before Retry-After: still refused
        clock.now += 0.5
        assert await admitted(b, acme)  # at Retry-After: admitted

    asyncio.run(run())


def test_token_reservations_stop_concurrent_long_streams_and_settle_refunds(authority):
    clock = Clock()
    a = TenantLimiter(authority, "ingress-a", lease_fraction=0.25, clock=clock)
    b = TenantLimiter(authority, "ingress-b", lease_fraction=0.25, clock=clock)
    acme = tenant(budget_tokens=10_000, budget_period="day", tokens_per_minute=1_000_000)

    async def run():
        held = []
        for i in range(40):  # many long streams at once: each reserves prompt 100 + max_tokens 900
            try:
                held.append(await (a if i % 2 else b).admit(acme, 1000))
            except TenantRefusal as exc:
                assert exc.code == "insufficient_quota"
        # Reservations stop them before the budget, not after: never past it, and at most one
        # request's reservation idles in the other replica's lease (the documented under-use).
        assert 10_000 - 1000 <= 1000 * len(held) <= 10_000
        for reservation in held:  # each generated only 100 of its 900
            (a if reservation in held[::2] else b).settle(reservation, 200)
        await a.sync()
        await b.sync()
        # The refunds are capacity again: each request now counts its 200.
        more = sum([await admitted(a if i % 2 else b, acme, 1000) for i in range(20)])
        capacity = 10_000 - 200 * len(held)
        assert capacity - 2000 <= 1000 * more <= capacity
        await a.sync()
        await b.sync()
        key = a.window(acme, "budget").key
        assert authority.committed(key, clock.now) <= 10_000

    asyncio.run(run())


def test_lost_replica_lease_expires_and_spent_budget_survives_restart(authority):
    clock = Clock()
    acme = tenant(budget_tokens=1000, budget_period="month")
    a = TenantLimiter(authority, "ingress-a", lease_fraction=0.5, lease_s=10, clock=clock)

    async def run():
        reservation = await a.admit(acme, 100)
        a.settle(reservation, 100)
        await a.sync()  # a holds a lease of 500, spent 100; then it dies without releasing
        b = TenantLimiter(authority, "ingress-b", lease_fraction=1.0, lease_s=10, clock=clock)
        assert not await admitted(b, acme, 501)  # a's unspent lease is still counted
        clock.now += 11  # a's lease expired: its unspent 400 return, its 100 spent stay
        assert await admitted(b, acme, 900)
        assert not await admitted(b, acme, 1)
        await b.release()
        restarted = TenantLimiter(authority, "ingress-c", clock=clock)  # a full restart
        assert not await admitted(restarted, acme, 1)
        assert restarted.remaining(acme, "budget")[0] == 0

    asyncio.run(run())


def test_in_flight_cap_and_unreachable_store_overshoot_is_one_chunk():
    class Down:
        def acquire(self, *args):
            raise OperationalError("SELECT", {}, ConnectionError("store down"))

    clock = Clock()
    limiter = TenantLimiter(Down(), "ingress-a", lease_fraction=0.1, clock=clock)
    acme = tenant(requests_per_minute=100, max_requests_in_flight=3)

    async def run():
        held = [await limiter.admit(acme, 0) for _ in range(3)]
        with pytest.raises(TenantRefusal):
            await limiter.admit(acme, 0)  # in flight
        for r in held:
            limiter.settle(r, 0)
        # 3 spent of a local fallback chunk of 10: 7 more, then refused (not locked out, bounded).
        count = 0
        for _ in range(20):
            r = await limiter.admit(acme, 0) if count < 7 else None
            if r is None:
                assert not await admitted(limiter, acme)
                break
            limiter.settle(r, 0)
            count += 1
        assert count == 7

    asyncio.run(run())


def test_a_renewal_snapshotted_before_a_refill_never_shrinks_the_lease(authority):
    """A stale renewal (its snapshot taken before a refill committed, written after) must not
    hand this replica's leased capacity to another replica: no overshoot across them."""
    clock = Clock()
    acme = tenant(requests_per_minute=20)
    a = TenantLimiter(authority, "ingress-a", lease_fraction=0.1, clock=clock)
    b = TenantLimiter(authority, "ingress-b", lease_fraction=1.0, clock=clock)

    async def run():
        await a.admit(acme, 0)  # a leases 2
        key = a.window(acme, "requests").key
        stale = {key: (a.windows[key].leased, a.windows[key].spent)}
        await a.admit(acme, 0)
        await a.admit(acme, 0)  # a refilled: leased 4, spent 3
        authority.renew("ingress-a", stale, clock.now, 15.0)  # the stale snapshot lands late
        admitted_b = sum([await admitted(b, acme) for _ in range(30)])
        assert 3 + admitted_b + (a.windows[key].leased - a.windows[key].spent) <= 20
        assert admitted_b == 16

    asyncio.run(run())
