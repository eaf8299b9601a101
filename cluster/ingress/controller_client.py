"""ControllerClient: an ingress's calls to the controller deployment through its Serve handle,
for one model of the deployment: membership, merged metrics, and the LoRA adapters loaded and
unloaded at runtime (the in-process Controller answers the same methods directly, and
InProcessControllerClient a ModelControllers in this process)."""

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

    async def load_lora_adapter(self, name: str, path: str) -> tuple[int, str]:
        """(HTTP status, message): cluster/control/lora_adapter_control.py."""
        return await self.handle.load_lora_adapter.remote(name, path, self.model)

    async def unload_lora_adapter(self, name: str) -> tuple[int, str]:
        return await self.handle.unload_lora_adapter.remote(name, self.model)
