"""The splitserve Ray Serve application: one ingress deployment that owns the prefill and
decode pools, the router, the OpenAI HTTP API and the gRPC server.

`splitserve serve` and the Helm chart's RayService both start it through build_app, from
the same ServeConfig fields: one source of truth.

The ingress starts the pools and the gRPC server in its (async) constructor, not in the ASGI
lifespan: a failure there reaches Ray Serve's deployment status as a StartupError naming the
root cause, which `splitserve serve` prints, where a lifespan failure would only say "ASGI
lifespan startup failed".
"""

from __future__ import annotations

import contextlib
import logging
import os

from ray import serve

from splitserve.cluster.config import ServeConfig

APP_IMPORT_PATH = "splitserve.cluster.app:build_app"
DEPLOYMENT_NAME = "splitserve"
logger = logging.getLogger(__name__)


class SplitServeIngress:
    """The ingress replica. Serve calls __serve_build_asgi_app__ after the constructor."""

    async def __init__(self, cfg_dict: dict):
        from splitserve.cluster.default_model import resolve_model
        from splitserve.cluster.frontend.backend import ServingBackend
        from splitserve.cluster.frontend.grpc.server import GrpcFrontend
        from splitserve.cluster.frontend.http.access_log import configure_replica_logging
        from splitserve.cluster.startup_error import StartupError, root_cause

        configure_replica_logging()
        cfg = ServeConfig.model_validate(cfg_dict)
        backend = grpc = None
        try:
            backend = ServingBackend(cfg, resolve_model(cfg.model))
            await backend.start()
            grpc = GrpcFrontend(backend, share_port=True)  # every ingress replica on a node serves the port
            await grpc.start(cfg.grpc_host, cfg.grpc_port)
        except Exception as exc:
            with contextlib.suppress(Exception):  # free what did start; the cause is what matters
                if grpc is not None:
                    await grpc.stop(0)
                if backend is not None:
                    await backend.shutdown()
            raise StartupError(root_cause(exc)) from None
        self.backend, self.grpc = backend, grpc

    def __serve_build_asgi_app__(self):
        from splitserve.cluster.frontend.http.api import build_http_app

        http_app = build_http_app(self.backend, echo_request_id=False)  # Serve echoes x-request-id itself

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            try:
                yield
            finally:
                await self.grpc.stop(5.0)
                await self.backend.shutdown()

        http_app.router.lifespan_context = lifespan
        http_app.state.backend = self.backend
        return http_app


def build_app(args: dict, fail_fast: bool = False) -> serve.Application:
    """Serve application builder (import path splitserve.cluster.app:build_app); args = ServeConfig.
    fail_fast: give up after the first failed start instead of Serve's 3 attempts (the CLI
    does, to report the cause in seconds; a RayService keeps retrying)."""
    args = dict(args or {})
    if not args.get("api_key") and os.environ.get("SPLITSERVE_API_KEY"):
        args["api_key"] = os.environ["SPLITSERVE_API_KEY"]  # e.g. from a Kubernetes Secret
    cfg = ServeConfig.model_validate(args)
    deployment = serve.deployment(
        serve.ingress()(SplitServeIngress),
        name=DEPLOYMENT_NAME,
        num_replicas=1,
        max_ongoing_requests=cfg.max_queued_requests + 64,  # admission control is ours (429)
        # On the head node: the Service / port-forward for HTTP and gRPC point there.
        ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
        health_check_period_s=5,
        # The HTTP app logs requests itself (scrapes at DEBUG, the path asked for on a 404).
        logging_config={"enable_access_log": False},
        **({"max_constructor_retry_count": 1} if fail_fast else {}),
    )
    return deployment.bind(cfg.model_dump())
