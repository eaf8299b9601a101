"""ControllerClient: an ingress's calls to the controller deployment through its Serve handle
(the in-process Controller answers the same two methods directly)."""

from __future__ import annotations

METRICS_TIMEOUT_S = 5.0


class ControllerClient:
    def __init__(self, handle):
        self.handle = handle  # a DeploymentHandle of ControllerDeployment

    async def membership(self, seen_version: int, ingress_id: str, report: bytes | None, wait_s: float) -> bytes | None:
        return await self.handle.membership.remote(seen_version, ingress_id, report, wait_s)

    async def render_metrics(self, ingress_id: str, families: bytes) -> bytes:
        return await self.handle.render_metrics.remote(ingress_id, families)
