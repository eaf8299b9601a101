"""ControllerClient: an ingress's calls to the controller deployment through its Serve handle,
for one model of the deployment (the in-process Controller answers the same two methods
directly, and InProcessControllerClient a ModelControllers in this process)."""

from __future__ import annotations

METRICS_TIMEOUT_S = 5.0


class ControllerClient:
    def __init__(self, handle, model: str | None = None):
        self.handle = handle  # a DeploymentHandle of ControllerDeployment
        self.model = model  # the served name whose pools this client follows (None: the only one)

    async def membership(self, seen_version: int, ingress_id: str, report: bytes | None, wait_s: float) -> bytes | None:
        return await self.handle.membership.remote(seen_version, ingress_id, report, wait_s, self.model)

    async def render_metrics(self, ingress_id: str, families: bytes) -> bytes:
        return await self.handle.render_metrics.remote(ingress_id, families, self.model)
