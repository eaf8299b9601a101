"""InProcessControllerClient: ControllerClient's calls (cluster/ingress/controller_client.py),
answered by a ModelControllers in this process for one model: an in-process ingress of a
deployment of several models (tests, tools) talks to its controllers as a Serve replica does."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.cluster.control.model_controllers import ModelControllers


class InProcessControllerClient:
    """ControllerClient's interface, answered by ModelControllers in this process."""

    def __init__(self, controllers: ModelControllers, model: str):
        self.controllers, self.model = controllers, model

    async def membership(self, seen_version: int, ingress_id: str, report: bytes | None, wait_s: float) -> bytes | None:
        return await self.controllers.membership(seen_version, ingress_id, report, wait_s, self.model)

    async def render_metrics(self, ingress_id: str, families: bytes) -> bytes:
        return self.controllers.render_metrics(ingress_id, families, self.model)

    async def load_lora_adapter(self, name: str, path: str) -> tuple[int, str]:
        return await self.controllers.load_lora_adapter(name, path, self.model)

    async def unload_lora_adapter(self, name: str) -> tuple[int, str]:
        return await self.controllers.unload_lora_adapter(name, self.model)
