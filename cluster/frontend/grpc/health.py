"""BackendHealthServicer: grpc.health.v1.Health that follows the serving backend's health."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2

from splitserve.cluster.frontend.model_catalog import ModelCatalog
from splitserve.cluster.frontend.serving_api import GenerationAPI

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# SERVING while the server can serve at all (a decode replica is live), degraded or not: what
# a liveness or readiness probe should check, so that losing one replica of several neither
# restarts the server nor takes it out of its load balancer.
READY_SERVICE = "splitserve.ready"


def pool_service_name(pool: str) -> str:
    """The health service name of one engine pool: Check it to learn whether that pool is at
    or above its floor (the overall status cannot say which pool degraded it)."""
    return f"splitserve.pool.{pool}"


class BackendHealthServicer(grpc_health.aio.HealthServicer):
    """SERVING while backend.health()["ok"] (every pool at or above its floor), NOT_SERVING
    otherwise, for the overall server ("") and each named service; each pool in
    backend.health()["pools"] also gets its own status under pool_service_name(pool), and
    READY_SERVICE follows backend.health()["serving"] (falling back to "ok"). Check re-reads
    the backend; a polling task keeps Watch streams current; enter_graceful_shutdown() pins
    everything to NOT_SERVING."""

    def __init__(
        self, backend: GenerationAPI | ModelCatalog, service_names: Iterable[str], poll_interval_s: float = 2.0
    ):
        super().__init__()
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self._backend = backend
        self._service_names = ("", *service_names)
        self._poll_interval_s = poll_interval_s
        self._poller: asyncio.Task | None = None
        self._pools_seen: set[str] = set()

    async def refresh(self) -> bool:
        """Read backend.health() and publish it; returns whether the backend is ok."""
        try:
            state = self._backend.health()
            ok, pools = bool(state.get("ok")), state.get("pools") or {}
            serving = bool(state.get("serving", ok))
        except Exception:  # a failing health probe is an unhealthy server, not a crashed RPC
            logger.warning("backend.health() failed; reporting NOT_SERVING", exc_info=True)
            ok, serving, pools = False, False, dict.fromkeys(self._pools_seen, {})
        for name in self._service_names:
            await self.set(name, SERVING if ok else NOT_SERVING)
        await self.set(READY_SERVICE, SERVING if serving else NOT_SERVING)
        for pool, pool_state in pools.items():
            self._pools_seen.add(pool)
            await self.set(pool_service_name(pool), SERVING if pool_state.get("ok") else NOT_SERVING)
        return ok

    async def Check(self, request, context):
        await self.refresh()
        return await super().Check(request, context)

    def start_polling(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="grpc-health-poll")

    async def stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._poll_interval_s)
