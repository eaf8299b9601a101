"""ModelControllers: the controller deployment's Controllers, one per model served.

Each model (ServeConfig.model_deployments()) gets its own Controller: its own prefill and
decode pools, targets, restart backoff, autoscaler and KV sizing, so the pools of one model
scale, fail and are replaced independently of the other's. A deployment of several models
gives each model's pool actors a namespace of its own (`splitserve-<app>--<model>`): the
actors' full names include the model, a restarted controller re-adopts each model's pools
by name, and a shutdown reaps one model's namespace without touching another's. A
deployment of one model keeps the app's namespace, as before.

The ingresses call membership(), render_metrics() and the LoRA adapter loads and unloads
(load_lora_adapter, unload_lora_adapter) naming the model (their
ControllerClient carries it). /metrics is one view: the controllers share one aggregator,
which keeps each ingress's samples per model, and every model's pool series is rendered.
"""

from __future__ import annotations

import asyncio

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.controller import Controller
from splitserve.cluster.control.in_process_controller_client import InProcessControllerClient
from splitserve.cluster.control.metrics_aggregator import MetricsAggregator
from splitserve.cluster.control.worker_pool import model_namespace
from splitserve.cluster.default_model import resolve_model


def hash_seed_of(cfg: ServeConfig, model_name: str) -> str | None:
    """The block-hash seed of a model's engines and routers: its served name where the
    deployment serves several (so equal token ids of two models never hash equal, even in one
    index); None for a deployment of one model (the unseeded chain, as before)."""
    return model_name if len(cfg.models) > 1 else None


class ModelControllers:
    def __init__(self, cfg: ServeConfig, app_name: str, autoscale: bool = True, model_dirs: dict | None = None):
        """model_dirs: {served name: checkpoint directory} already resolved (else resolved here)."""
        deployments = cfg.model_deployments()
        self.aggregator = MetricsAggregator()
        shared = len(deployments) > 1
        self.controllers: dict[str, Controller] = {}
        for name, one in deployments:
            model_dir = (model_dirs or {}).get(name) or resolve_model(one.model)
            self.controllers[name] = Controller(
                one,
                model_dir,
                app_name,
                autoscale=autoscale,
                namespace=model_namespace(app_name, name) if shared else None,
                aggregator=self.aggregator if shared else None,
                hash_seed=hash_seed_of(cfg, name),
            )

    @property
    def names(self) -> list[str]:
        return list(self.controllers)

    def get(self, model: str | None) -> Controller:
        """The controller of a served name; None: the first model (a caller of one model)."""
        if model is None:
            return next(iter(self.controllers.values()))
        try:
            return self.controllers[model]
        except KeyError:
            raise KeyError(f"no model {model!r} in this deployment (it serves {self.names})") from None

    async def start(self) -> None:
        """Start every model's pools; if one fails, stop the others' and raise its error."""
        controllers = list(self.controllers.values())
        results = await asyncio.gather(*(c.start() for c in controllers), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            started = [c for c, r in zip(controllers, results) if not isinstance(r, BaseException)]
            await asyncio.gather(*(c.shutdown() for c in started), return_exceptions=True)
            raise failed

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.controllers.values()))

    async def membership(
        self, seen_version: int, ingress_id: str, report: bytes | None, wait_s: float, model: str | None
    ) -> bytes | None:
        return await self.get(model).membership(seen_version, ingress_id, report, wait_s)

    async def load_lora_adapter(self, name: str, path: str, model: str | None) -> tuple[int, str]:
        return await self.get(model).load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str, model: str | None) -> tuple[int, str]:
        return await self.get(model).unload_lora_adapter(name)

    def render_metrics(self, ingress_id: str, families: bytes, model: str | None) -> bytes:
        """The merged /metrics of every model; families: the calling ingress's samples of `model`."""
        if len(self.controllers) == 1:
            return self.get(model).render_metrics(ingress_id, families)
        controller = self.get(model)
        controller.render_metrics(ingress_id, families)  # takes the samples
        for c in self.controllers.values():
            c.roster.refresh_gauges()
        return self.aggregator.render([c.metrics.registry for c in self.controllers.values()])

    def client(self, model: str) -> InProcessControllerClient:
        """What an in-process ingress backend of `model` calls (tests, tools): the same two
        methods the controller deployment's handle answers."""
        self.get(model)
        return InProcessControllerClient(self, model)
