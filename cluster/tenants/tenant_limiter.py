"""Admission against a tenant's limits, enforced locally on capacity leased from the store.

Per tenant and limit (requests/min, tokens/min, the budget) an ingress replica holds a lease
for the current window: `leased` capacity of which it has `spent` some. Admission spends from
it with no round trip; only when it runs short does the replica lease another chunk
(lease_fraction of the limit, or what the request needs) from the SqlQuotaAuthority. Tokens
are reserved at admission (prompt + max_tokens) and the unused part is refunded when the
request settles, so the leases of all replicas together never exceed a limit. If the store
cannot be reached, a replica grants itself at most one extra chunk per window (bounded
overshoot rather than locking tenants out), and says so in its log.

`clock` is injectable: tests move time instead of sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.exc import SQLAlchemyError

from splitserve.cluster.tenants.quota_window import BUDGET, REQUESTS, TOKENS, window_bounds
from splitserve.cluster.tenants.sql_quota_authority import SqlQuotaAuthority, WindowKey
from splitserve.cluster.tenants.tenant_config import TenantConfig
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal

logger = logging.getLogger(__name__)


@dataclass
class LocalWindow:
    key: WindowKey
    leased: float = 0.0
    spent: float = 0.0
    others: float = 0.0  # committed by other replicas, as of the last store round trip
    fallback_used: bool = False

    def free(self) -> float:
        return self.leased - self.spent


@dataclass
class Reservation:
    tenant: TenantConfig
    tokens: float
    spent: list[tuple[LocalWindow, float]] = field(default_factory=list)
    settled: bool = False


def limit_of(tenant: TenantConfig, kind: str) -> int | None:
    return {REQUESTS: tenant.requests_per_minute, TOKENS: tenant.tokens_per_minute, BUDGET: tenant.budget_tokens}[kind]


class TenantLimiter:
    def __init__(
        self,
        authority: SqlQuotaAuthority,
        holder: str,
        lease_fraction: float = 0.1,
        lease_s: float = 15.0,
        clock: Callable[[], float] = time.time,
    ):
        self.authority = authority
        self.holder = holder
        self.lease_fraction = lease_fraction
        self.lease_s = lease_s
        self.clock = clock
        self.windows: dict[WindowKey, LocalWindow] = {}
        self.inflight: dict[str, int] = defaultdict(int)
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # One store call at a time: a renewal that snapshotted `leased` before a refill and
        # wrote it after would shrink this replica's lease in the store below what it spends
        # from, and another replica could lease that capacity again (an overshoot).
        self._store_lock = asyncio.Lock()

    def window(self, tenant: TenantConfig, kind: str, now: float | None = None) -> LocalWindow:
        start, end = window_bounds(kind, tenant.budget_period, self.clock() if now is None else now)
        key = WindowKey(tenant.name, kind, start, end)
        found = self.windows.get(key)
        if found is None:
            found = self.windows[key] = LocalWindow(key)
        return found

    async def admit(self, tenant: TenantConfig, tokens: float) -> Reservation:
        """Spends one request and `tokens` from the tenant's limits, or raises TenantRefusal
        (nothing spent) with the time until the refusing window resets. The common case --
        every lease has room -- takes no lock and never yields to the event loop (no convoy
        of clients queueing behind one tenant's lock); only a refill takes the tenant's lock."""
        needs = self._needs(tenant, tokens, self.clock())
        if all(window.free() >= need for window, need, _ in needs):
            return self._spend(tenant, tokens, needs)
        async with self._locks[tenant.name]:
            now = self.clock()
            needs = self._needs(tenant, tokens, now)
            for window, need, limit in needs:
                if window.free() < need:
                    await self._refill(window, need, limit, now)
            # Checked again after every await, then spent at once (no await in between).
            needs = self._needs(tenant, tokens, now)
            for window, need, limit in needs:
                if window.free() < need:
                    raise _refusal(tenant, window.key.kind, need, limit, window.key.window_end - now)
            return self._spend(tenant, tokens, needs)

    def _needs(self, tenant: TenantConfig, tokens: float, now: float) -> list[tuple[LocalWindow, float, int]]:
        """(window, amount, limit) of each limit the tenant has; refuses past its in-flight cap."""
        cap = tenant.max_requests_in_flight
        if cap is not None and self.inflight[tenant.name] >= cap:
            raise TenantRefusal.rate(f"tenant {tenant.name!r} has {cap} requests in flight (its limit)", 1.0)
        needs = []
        for kind, need in ((REQUESTS, 1.0), (TOKENS, tokens), (BUDGET, tokens)):
            limit = limit_of(tenant, kind)
            if limit is not None:
                needs.append((self.window(tenant, kind, now), need, limit))
        return needs

    def _spend(self, tenant: TenantConfig, tokens: float, needs) -> Reservation:
        reservation = Reservation(tenant, tokens)
        for window, need, _ in needs:
            window.spent += need
            reservation.spent.append((window, need))
        self.inflight[tenant.name] += 1
        return reservation

    def settle(self, reservation: Reservation, tokens: float) -> None:
        """The request ended having used `tokens` (weighted): refund the rest of its reservation."""
        if reservation.settled:
            return
        reservation.settled = True
        self.inflight[reservation.tenant.name] -= 1
        refund = max(reservation.tokens - tokens, 0.0)
        for window, _ in reservation.spent:
            if window.key.kind != REQUESTS:
                window.spent -= refund

    async def _refill(self, window: LocalWindow, need: float, limit: float, now: float) -> None:
        want = max(need, math.ceil(limit * self.lease_fraction))
        try:
            async with self._store_lock:
                grant = await asyncio.to_thread(
                    self.authority.acquire, window.key, self.holder, window.spent, want, limit, now, self.lease_s
                )
                window.leased, window.others = grant.leased, grant.others
        except (SQLAlchemyError, OSError) as exc:  # the store, not a bug here, failed
            if window.fallback_used:
                return
            window.fallback_used = True
            window.leased = max(window.leased, window.spent) + want
            logger.warning(
                "tenant %s: the state store is unreachable (%r); leased %g locally", window.key.tenant, exc, want
            )

    def remaining(self, tenant: TenantConfig, kind: str) -> tuple[int, float] | None:
        """(remaining, seconds to reset) of a limit across all replicas, as this one knows it."""
        limit = limit_of(tenant, kind)
        if limit is None:
            return None
        now = self.clock()
        window = self.window(tenant, kind, now)
        return max(0, math.floor(limit - window.others - window.spent)), window.key.window_end - now

    async def sync(self) -> None:
        """Renews every lease, reports spending, learns the others'; forgets ended windows."""
        async with self._store_lock:
            now = self.clock()
            rows = {key: (w.leased, w.spent) for key, w in self.windows.items()}
            if not rows:
                return
            others = await asyncio.to_thread(self.authority.renew, self.holder, rows, now, self.lease_s)
        for key, value in others.items():
            if key in self.windows:
                self.windows[key].others = value
        for key in [k for k in self.windows if k.window_end < now]:
            del self.windows[key]

    async def release(self) -> None:
        async with self._store_lock:
            rows = {key: (w.leased, w.spent) for key, w in self.windows.items()}
            if rows:
                await asyncio.to_thread(self.authority.release, self.holder, rows, self.clock())


def _refusal(tenant: TenantConfig, kind: str, need: float, limit: int, reset_s: float) -> TenantRefusal:
    if kind == BUDGET:
        return TenantRefusal.quota(
            f"tenant {tenant.name!r} has used its budget of {limit} tokens this {tenant.budget_period}", reset_s
        )
    if kind == REQUESTS:
        return TenantRefusal.rate(f"tenant {tenant.name!r} is over its limit of {limit} requests per minute", reset_s)
    if need > limit:
        return TenantRefusal.rate(
            f"the request reserves {need:g} tokens (prompt + max_tokens), more than tenant {tenant.name!r}'s "
            f"limit of {limit} tokens per minute; lower max_tokens",
            reset_s,
        )
    return TenantRefusal.rate(f"tenant {tenant.name!r} is over its limit of {limit} tokens per minute", reset_s)
