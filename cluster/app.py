"""The splitserve Ray Serve application: a one-replica controller deployment that owns the
prefill and decode pools (one Controller per model served, cluster/control/model_controllers.py),
and the `splitserve` ingress deployment (N stateless replicas: OpenAI HTTP, gRPC, and per
model a tokenizer, router and dispatcher, resolved by name in a ModelCatalog) that follows
the controller's membership.

`splitserve serve` and the Helm chart's RayService both start it through build_app, from
the same ServeConfig fields: one source of truth.

What dies with what: the pools are named, detached actors in the app's namespace, so they
outlive both deployments' replicas. The controller dying changes nothing for serving (each
ingress keeps its last view, KV events flow replica -> ingress directly); Serve restarts it
and it re-adopts the pools. An ingress replica dying loses only the streams it carried.
Deleting the app (Ctrl-C, `serve shutdown`, a RayService delete) runs the controller's
__del__, which kills the pools.

Both start in their (async) constructors, not in the ASGI lifespan: a failure there reaches
Ray Serve's deployment status as a StartupError naming the root cause, which `splitserve
serve` prints, where a lifespan failure would only say "ASGI lifespan startup failed".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os

from ray import serve

from splitserve.cluster.config import ServeConfig

APP_IMPORT_PATH = "splitserve.cluster.app:build_app"
DEPLOYMENT_NAME = "splitserve"
CONTROLLER_DEPLOYMENT_NAME = "splitserve-controller"
logger = logging.getLogger(__name__)
# Seconds the replica's own listener lets open requests finish when the replica stops; under
# Serve's graceful_shutdown_timeout_s (20 s), which bounds the whole lifespan shutdown.
LISTENER_GRACE_S = 10.0


class ControllerDeployment:
    """The controller replica: cluster/control/controller.py's Controller behind a Serve handle."""

    async def __init__(self, cfg_dict: dict):
        from splitserve.cluster.control.model_controllers import ModelControllers
        from splitserve.cluster.frontend.http.access_log import configure_replica_logging
        from splitserve.cluster.startup_error import StartupError, root_cause

        configure_replica_logging()
        cfg = ServeConfig.model_validate(cfg_dict)
        # Before Serve starts this replica's uvicorn (after this constructor): time headers out.
        from splitserve.cluster.frontend.http import header_timeout

        header_timeout.install(cfg.http_request_timeout_s)
        self.controllers = None
        try:
            # One Controller per model (its own pools, autoscaler and KV sizing).
            controllers = ModelControllers(cfg, serve.get_replica_context().app_name)
            await controllers.start()  # a fresh start that fails leaves nothing running
        except Exception as exc:
            raise StartupError(root_cause(exc)) from None
        self.controllers = controllers

    async def membership(
        self,
        seen_version: int,
        ingress_id: str,
        report: bytes | None = None,
        wait_s: float = 0.0,
        model: str | None = None,
    ):
        """model: the served name whose pools the ingress follows (None: the first model)."""
        return await self.controllers.membership(seen_version, ingress_id, report, wait_s, model)

    async def render_metrics(self, ingress_id: str, families: bytes, model: str | None = None) -> bytes:
        return self.controllers.render_metrics(ingress_id, families, model)

    async def load_lora_adapter(self, name: str, path: str, model: str | None = None) -> tuple[int, str]:
        return await self.controllers.load_lora_adapter(name, path, model)

    async def unload_lora_adapter(self, name: str, model: str | None = None) -> tuple[int, str]:
        return await self.controllers.unload_lora_adapter(name, model)

    async def __del__(self):
        """The app is deleted (or this replica is stopped by Serve): the pools go with it. A
        controller that is killed instead never gets here, so its pools keep serving."""
        if self.controllers is not None:
            await self.controllers.shutdown()


class SplitServeIngress:
    """An ingress replica. Serve calls __serve_build_asgi_app__ after the constructor."""

    async def __init__(self, cfg_dict: dict, controller_handle):
        from splitserve.cluster.control.model_controllers import hash_seed_of
        from splitserve.cluster.default_model import resolve_model
        from splitserve.cluster.frontend.backend import ServingBackend
        from splitserve.cluster.frontend.grpc.server import GrpcFrontend
        from splitserve.cluster.frontend.http.access_log import configure_replica_logging
        from splitserve.cluster.frontend.model_catalog import ModelCatalog
        from splitserve.cluster.frontend.model_router.model_route_set import register_model_routes
        from splitserve.cluster.ingress.controller_client import ControllerClient
        from splitserve.cluster.startup_error import StartupError, root_cause

        configure_replica_logging()
        cfg = ServeConfig.model_validate(cfg_dict)
        # Before Serve starts this replica's uvicorn (after this constructor): time headers out.
        from splitserve.cluster.frontend.http import header_timeout

        header_timeout.install(cfg.http_request_timeout_s)
        backends: list = []
        grpc = batch = listener = None
        try:
            # One backend per model (tokenizer, router and KV index, dispatcher, metrics), all
            # sharing the first one's admission and tenant gate; the catalog resolves `model`.
            for name, one in cfg.model_deployments():
                backends.append(
                    ServingBackend(
                        one,
                        resolve_model(one.model),
                        controller=ControllerClient(controller_handle, name),
                        share_with=backends[0] if backends else None,
                        hash_seed=hash_seed_of(cfg, name),
                    )
                )
            backend, catalog = backends[0], ModelCatalog.of(*backends)
            for one_backend in backends:  # adapters loaded and unloaded at runtime, from the controller's view
                one_backend.cluster.follower.on_view = functools.partial(
                    _serve_adapters, catalog, one_backend.model_name
                )
            # Aliases and virtual models resolve to the served models' backends.
            register_model_routes(catalog, cfg, backend.metrics.registry)
            if cfg.batch.enabled:  # opens the state store: a bad state_url fails the start, in one line
                from splitserve.cluster.batch.batch_service import BatchService

                batch = BatchService(cfg, backend.ingress_id, backend.metrics.registry, backend.model_name)
            await asyncio.gather(*(b.start() for b in backends))
            # every ingress replica on a node serves the port
            grpc = GrpcFrontend(backend, share_port=True, catalog=catalog)
            await grpc.start(cfg.grpc_host, cfg.grpc_port)
            listener = _own_listener(cfg)  # a taken HTTP port fails the start here, named
        except Exception as exc:
            with contextlib.suppress(Exception):  # free what did start; the cause is what matters
                if batch is not None:
                    await batch.stop()
                if grpc is not None:
                    await grpc.stop(0)
                for b in backends:
                    await b.shutdown()
            raise StartupError(root_cause(exc)) from None
        self.backend, self.backends, self.catalog, self.grpc, self.batch = backend, backends, catalog, grpc, batch
        self.listener = listener

    def __serve_build_asgi_app__(self):
        from splitserve.cluster.frontend.http.api import build_http_app

        # Serve echoes x-request-id itself; the replica's own listener does not
        http_app = build_http_app(
            self.backend, echo_request_id=self.listener is not None, batch=self.batch, catalog=self.catalog
        )

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            if self.batch is not None:
                self.batch.start()  # works only while this replica holds the runner lease
            if self.listener is not None:
                await self.listener.serve(http_app)
            try:
                yield
            finally:
                if self.listener is not None:  # first: no new request reaches a backend shutting down
                    await self.listener.stop(LISTENER_GRACE_S)
                if self.batch is not None:
                    await self.batch.stop()
                await self.grpc.stop(5.0)
                for backend in self.backends:
                    await backend.shutdown()

        http_app.router.lifespan_context = lifespan
        http_app.state.backend = self.backend
        return http_app


def _own_listener(cfg: ServeConfig):
    """The replica's own bound HTTP listener where cfg says it answers on the port itself."""
    if cfg.http_listener != "ingress":
        return None
    from splitserve.cluster.frontend.http.ingress_listener import IngressListener

    listener = IngressListener(cfg.http_host, cfg.http_port, cfg.http_keep_alive_timeout_s)
    try:
        listener.bind()
    except OSError as exc:
        raise RuntimeError(f"cannot listen for HTTP on {cfg.http_host}:{cfg.http_port}: {exc.strerror}") from None
    return listener


def _serve_adapters(catalog, model_name: str, view) -> None:
    catalog.set_adapters(model_name, view.lora_adapters)


def ingress_options(cfg: ServeConfig) -> dict:
    """The ingress deployment's replica count or Serve autoscaling, from cfg.ingress."""
    ingress = cfg.ingress
    if not ingress.autoscaling.enabled:
        return {"num_replicas": ingress.replicas}
    a = ingress.autoscaling
    return {
        "autoscaling_config": {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": min(max(ingress.replicas, a.min_replicas), a.max_replicas),
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
        }
    }


def build_app(args: dict, fail_fast: bool = False) -> serve.Application:
    """Serve application builder (import path splitserve.cluster.app:build_app); args = ServeConfig.
    fail_fast: give up after the first failed start instead of Serve's 3 attempts (the CLI
    does, to report the cause in seconds; a RayService keeps retrying)."""
    args = dict(args or {})
    if not args.get("api_key") and os.environ.get("SPLITSERVE_API_KEY"):
        args["api_key"] = os.environ["SPLITSERVE_API_KEY"]  # e.g. from a Kubernetes Secret
    cfg = ServeConfig.model_validate(args)
    retries = {"max_constructor_retry_count": 1} if fail_fast else {}
    controller = serve.deployment(
        ControllerDeployment,
        name=CONTROLLER_DEPLOYMENT_NAME,
        num_replicas=1,
        # Every ingress long-polls it; drains and scale-ups wait on it too.
        max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0},
        # Loading the pools can take minutes; the ingresses wait for its first view.
        health_check_period_s=5,
        graceful_shutdown_timeout_s=60,
        logging_config={"enable_access_log": False},
        **retries,
    )
    ingress = serve.deployment(
        serve.ingress()(SplitServeIngress),
        name=DEPLOYMENT_NAME,
        max_ongoing_requests=cfg.max_queued_requests + 64,  # admission control is ours (429)
        ray_actor_options={"num_cpus": cfg.ingress.num_cpus, "resources": dict(cfg.ingress.resources)},
        health_check_period_s=5,
        # The HTTP app logs requests itself (scrapes at DEBUG, the path asked for on a 404).
        logging_config={"enable_access_log": False},
        **ingress_options(cfg),
        **retries,
    )
    cfg_dict = cfg.model_dump()
    return ingress.bind(cfg_dict, controller.bind(cfg_dict))
