"""A deployment of several models in-process (local Ray): what a test drives over HTTP and gRPC."""

from __future__ import annotations

import uuid

import ray

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.model_controllers import ModelControllers, hash_seed_of
from splitserve.cluster.frontend.backend import ServingBackend
from splitserve.cluster.frontend.grpc.server import GrpcFrontend
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.model_catalog import ModelCatalog
from splitserve.proto.messages.poll_reply import PollReply
from tests.helpers.cluster import LoopHttpServer, wait_until


class ModelsDeployment:
    """Several models in one deployment: one ModelControllers (a Controller per model, as the
    controller deployment runs them), a ServingBackend per model sharing one admission, one
    ModelCatalog behind the real HTTP app and gRPC frontend."""

    def __init__(self, loop, cfg: ServeConfig):
        self.loop = loop
        self.controllers = ModelControllers(cfg, f"test-{uuid.uuid4().hex[:8]}", autoscale=False)
        loop.run(self.controllers.start(), timeout=300)
        self.backends: dict[str, ServingBackend] = {}
        for name, one in cfg.model_deployments():
            first = next(iter(self.backends.values()), None)
            client = self.controllers.client(name)
            self.backends[name] = ServingBackend(
                one, one.model, controller=client, share_with=first, hash_seed=hash_seed_of(cfg, name)
            )
        loop.run(_start_all(self.backends.values()), timeout=300)
        self.catalog = ModelCatalog.of(*self.backends.values())
        default = next(iter(self.backends.values()))
        self.grpc = GrpcFrontend(default, catalog=self.catalog)
        self.grpc_port = loop.run(self.grpc.start("127.0.0.1", 0))
        self.http = LoopHttpServer(loop, build_http_app(default, catalog=self.catalog)).__enter__()

    def close(self) -> None:
        self.http.__exit__(None, None, None)
        self.loop.run(self.grpc.stop(1.0))
        for backend in self.backends.values():
            self.loop.run(backend.shutdown(), timeout=60)
        self.loop.run(self.controllers.shutdown(), timeout=120)

    def pools(self, model: str) -> dict:
        return self.controllers.controllers[model].pools

    def baseline(self, timeout_s: float = 30.0) -> None:
        """Every live replica of both models holds no blocks, pins nothing, runs nothing."""

        def idle() -> bool:
            for name in self.backends:
                for pool in self.pools(name).values():
                    for replica in pool.live_replicas():
                        s = PollReply.from_bytes(ray.get(replica.handle.poll.remote(), timeout=30))
                        e = s.engine
                        if e.num_free_blocks != e.num_blocks or s.num_pinned or e.num_running or e.num_waiting:
                            return False
            return True

        wait_until(idle, timeout_s, "block pools not back to baseline", interval_s=0.2)


async def _start_all(backends) -> None:
    for backend in backends:
        await backend.start()
