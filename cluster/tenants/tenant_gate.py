"""The ingress's tenant enforcement: who a key is, whether it may use a model, admission
against its limits, settling and metering what it used, and the background tick that reloads
the tenants file, renews leases and writes usage. HTTP and gRPC both call it.

A TenantTicket follows one API request (which may fan out into several generations, n > 1):
each generation reports what it used; the ticket settles once the request is over and every
generation it started has ended, and not before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from splitserve.cluster.tenants.quota_window import BUDGET, REQUESTS, TOKENS
from splitserve.cluster.tenants.sql_quota_authority import SqlQuotaAuthority
from splitserve.cluster.tenants.sql_usage_store import SqlUsageStore, UsageCounts
from splitserve.cluster.tenants.tenant_config import TenantConfig
from splitserve.cluster.tenants.tenant_directory import TenantDirectory, file_stamps, watched_files
from splitserve.cluster.tenants.tenant_limiter import Reservation, TenantLimiter, limit_of
from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal
from splitserve.cluster.tenants.tenants_file import TenantsFileError
from splitserve.cluster.tenants.usage_meter import UsageMeter

logger = logging.getLogger(__name__)


class TenantTicket:
    def __init__(
        self, gate: TenantGate, reservation: Reservation, model: str, prompt_tokens: int, headers: dict[str, str]
    ):
        self.gate, self.reservation, self.model, self.headers = gate, reservation, model, headers
        self.tenant = reservation.tenant
        # Each prompt counts once however many choices it has, as the response's usage does.
        self.usage = UsageCounts(requests=1, prompt_tokens=prompt_tokens)
        self._cached: dict[int, int] = {}
        self._running = 0
        self._closed = False
        self._settled = False

    @property
    def priority(self) -> int:
        return self.tenant.priority

    def part(self, prompt_index: int) -> TicketPart:
        return TicketPart(self, prompt_index)

    def close(self) -> None:
        """The API request is over (answered, streamed, or abandoned)."""
        self._closed = True
        self._maybe_settle()

    def _maybe_settle(self) -> None:
        if self._closed and self._running == 0 and not self._settled:
            self._settled = True
            self.usage.cached_tokens = sum(self._cached.values())
            self.gate.settle(self)


class TicketPart:
    """One generation (one choice of one prompt) of a ticket's request."""

    def __init__(self, ticket: TenantTicket, prompt_index: int):
        self.ticket, self.prompt_index = ticket, prompt_index

    def started(self) -> None:
        self.ticket._running += 1

    def finished(self, cached: int, completion: int, failed: bool) -> None:
        ticket = self.ticket
        ticket._running -= 1
        ticket._cached[self.prompt_index] = max(ticket._cached.get(self.prompt_index, 0), cached)
        ticket.usage.completion_tokens += completion
        ticket.usage.errors = 1 if failed else ticket.usage.errors
        ticket._maybe_settle()


class TenantGate:
    def __init__(
        self,
        cfg,
        engine,
        holder: str,
        metrics: TenantMetrics,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self.directory = TenantDirectory.load(cfg.tenants, cfg.tenants_file, cfg.api_key)  # a bad file: startup error
        self._stamps = file_stamps(watched_files(cfg.tenants, cfg.tenants_file, self.directory))
        self.limiter = TenantLimiter(
            SqlQuotaAuthority(engine), holder, cfg.tenant_lease_fraction, cfg.tenant_lease_s, clock
        )
        self.usage_store = SqlUsageStore(engine)
        self.meter = UsageMeter(self.usage_store)
        self.metrics = metrics
        self.clock = clock
        self.metrics.last_reload.set(clock())
        self._task: asyncio.Task | None = None

    # ---- admission ----------------------------------------------------------------------
    def authenticate(self, key: str | None) -> TenantConfig:
        tenant = self.directory.lookup(key)
        if tenant is None:
            raise TenantRefusal.unknown_key()
        return tenant

    async def admit(self, key: str | None, model: str, prompt_tokens: int, max_tokens: int) -> TenantTicket:
        """Raises TenantRefusal (with the tenant's x-ratelimit headers once it is known)."""
        return await self._admit(self.authenticate(key), model, prompt_tokens, max_tokens)

    async def admit_tenant(self, name: str, model: str, prompt_tokens: int, max_tokens: int) -> TenantTicket:
        """admit for the tenant itself, not a key of it (a Batch API line runs as its batch's
        owner): refused as a revoked key is once the tenant is no longer configured."""
        tenant = self.directory.tenants.get(name)
        if tenant is None:
            raise TenantRefusal.tenant_removed(name)
        return await self._admit(tenant, model, prompt_tokens, max_tokens)

    async def _admit(self, tenant: TenantConfig, model: str, prompt_tokens: int, max_tokens: int) -> TenantTicket:
        if not tenant.allows_model(model):
            self.metrics.requests.labels(tenant.name, "model_not_allowed").inc()
            raise TenantRefusal.model_not_allowed(model)
        if tenant.max_tokens_reserved is not None:
            max_tokens = min(max_tokens, tenant.max_tokens_reserved)
        try:
            reservation = await self.limiter.admit(tenant, float(prompt_tokens + max_tokens))
        except TenantRefusal as refusal:
            refusal.headers = self.headers(tenant)
            outcome = "over_budget" if refusal.code == "insufficient_quota" else "rate_limited"
            self.metrics.requests.labels(tenant.name, outcome).inc()
            raise
        return TenantTicket(self, reservation, model, prompt_tokens, self.headers(tenant))

    def settle(self, ticket: TenantTicket) -> None:
        tenant, usage = ticket.tenant, ticket.usage
        weighted = usage.prompt_tokens - usage.cached_tokens * (1 - tenant.cached_token_weight)
        self.limiter.settle(ticket.reservation, weighted + usage.completion_tokens)
        self.meter.record(tenant.name, ticket.model, self.clock(), usage)
        self.metrics.requests.labels(tenant.name, "error" if usage.errors else "ok").inc()
        for kind, value in (
            ("prompt", usage.prompt_tokens),
            ("cached", usage.cached_tokens),
            ("completion", usage.completion_tokens),
        ):
            self.metrics.tokens.labels(tenant.name, kind).inc(value)
        self._update_budget_gauge(tenant)

    def headers(self, tenant: TenantConfig) -> dict[str, str]:
        """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the tenant."""
        headers = {}
        for kind in (REQUESTS, TOKENS):
            state = self.limiter.remaining(tenant, kind)
            if state is None:
                continue
            remaining, reset_s = state
            headers[f"x-ratelimit-limit-{kind}"] = str(limit_of(tenant, kind))
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = f"{max(math.ceil(reset_s), 0)}s"
        return headers

    def _update_budget_gauge(self, tenant: TenantConfig) -> None:
        state = self.limiter.remaining(tenant, BUDGET)
        if state is not None:
            self.metrics.budget_remaining.labels(tenant.name).set(state[0])

    # ---- reload and sync ----------------------------------------------------------------
    def reload(self) -> None:
        """Re-reads the tenants file and keys files; on an error keeps the old tenants and
        raises TenantsFileError (naming the file and line)."""
        try:
            directory = TenantDirectory.load(self.cfg.tenants, self.cfg.tenants_file, self.cfg.api_key)
        except Exception as exc:
            self.metrics.reload_errors.inc()
            if isinstance(exc, TenantsFileError):
                raise
            # A reader's bug must not leave the reload loop dead, nor /admin/reload a 500.
            raise TenantsFileError(f"{self.cfg.tenants_file}: cannot be read: {exc!r}") from exc
        self.directory = directory
        self.metrics.last_reload.set(self.clock())
        logger.info("tenants reloaded: %d tenants", len(directory))

    def reload_if_changed(self) -> None:
        """Reloads when a watched file changed; an unusable file is logged and counted once per
        change (the next change is tried again), and the old tenants stay."""
        stamps = file_stamps(watched_files(self.cfg.tenants, self.cfg.tenants_file, self.directory))
        if stamps == self._stamps:
            return
        self._stamps = stamps
        try:
            self.reload()
        except TenantsFileError as exc:
            logger.error("tenants file not reloaded, keeping the previous tenants: %s", exc)

    async def tick(self) -> None:
        """One pass of the background loop: reload, renew leases, write usage, update gauges.
        Each stage's failure is logged and counted, and never stops the stages after it."""
        self.reload_if_changed()
        for stage, work in (("leases", self.limiter.sync), ("usage", self._flush_usage)):
            try:
                await work()
            except Exception as exc:
                self.metrics.sync_errors.labels(stage).inc()
                logger.warning("tenant %s sync with the state store failed (%r); retrying next tick", stage, exc)
        for tenant in self.directory.tenants.values():
            self._update_budget_gauge(tenant)

    async def _flush_usage(self) -> None:
        await asyncio.to_thread(self.meter.flush)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        interval = min(self.cfg.tenant_sync_s, self.cfg.tenants_reload_s)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.tick()
            except Exception:  # whatever it was, the next tick runs (a revoked key must still go)
                logger.exception("tenant tick failed; the next one runs in %.3g s", interval)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self.limiter.release()
            await asyncio.to_thread(self.meter.flush)
        except Exception as exc:
            logger.warning("tenant usage not written at shutdown: %r", exc)
