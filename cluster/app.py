"""The splitserve Ray Serve application: one ingress deployment that owns the prefill and
decode pools, the router, the OpenAI HTTP API and the gRPC server.

`splitserve serve` and the Helm chart's RayService both start it through build_app, from
the same ServeConfig fields: one source of truth.
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


def _make_asgi_builder(cfg_dict: dict):
    def build_asgi():
        # Runs inside the replica: the pools, the router and the servers live there.
        from splitserve.cluster.default_model import resolve_model
        from splitserve.cluster.frontend.backend import ServingBackend
        from splitserve.cluster.frontend.grpc.server import GrpcFrontend
        from splitserve.cluster.frontend.http.api import build_http_app

        cfg = ServeConfig.model_validate(cfg_dict)
        backend = ServingBackend(cfg, resolve_model(cfg.model))
        http_app = build_http_app(backend)

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            await backend.start()
            grpc = GrpcFrontend(backend)
            port = await grpc.start(cfg.grpc_host, cfg.grpc_port)
            logger.info("splitserve gRPC listening on %s:%d", cfg.grpc_host, port)
            try:
                yield
            finally:
                await grpc.stop(5.0)
                await backend.shutdown()

        http_app.router.lifespan_context = lifespan
        http_app.state.backend = backend
        return http_app

    return build_asgi


def build_app(args: dict) -> serve.Application:
    """Serve application builder (import path splitserve.cluster.app:build_app); args = ServeConfig."""
    args = dict(args or {})
    if not args.get("api_key") and os.environ.get("SPLITSERVE_API_KEY"):
        args["api_key"] = os.environ["SPLITSERVE_API_KEY"]  # e.g. from a Kubernetes Secret
    cfg = ServeConfig.model_validate(args)

    class SplitServeFrontend:
        """Ingress replica; routes come from the ASGI app built on the replica."""

    deployment = serve.deployment(
        serve.ingress(_make_asgi_builder(cfg.model_dump()))(SplitServeFrontend),
        name=DEPLOYMENT_NAME,
        num_replicas=1,
        max_ongoing_requests=cfg.max_queued_requests + 64,  # admission control is ours (429)
        # On the head node: the Service / port-forward for HTTP and gRPC point there.
        ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
        health_check_period_s=5,
    )
    return deployment.bind()
