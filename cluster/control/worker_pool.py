"""A pool of prefill or decode Ray actors with a per-replica resource request.

Replicas are plain Ray actors: a request for `num_gpus` or a custom resource that no node
has yet stays pending, which is exactly what Ray's autoscaler (ray up / KubeRay) scales on.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from splitserve.cluster.config import PoolResources

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    replica_id: str
    pool: str
    handle: Any
    started_at: float = field(default_factory=time.monotonic)
    draining: bool = False
    ready: bool = False


class WorkerPool:
    def __init__(
        self,
        pool: str,
        worker_cls: type,
        engine_config: dict,
        resources: PoolResources,
        transport_host: str = "127.0.0.1",
        transfer_timeout_s: float = 20.0,
        torch_threads: int | None = None,
        namespace: str | None = None,
        start_timeout_s: float = 300.0,
    ):
        self.pool = pool
        self.remote_cls = ray.remote(worker_cls)
        self.engine_config = dict(engine_config)
        self.resources = resources
        self.transport_host = transport_host
        self.transfer_timeout_s = transfer_timeout_s
        self.torch_threads = torch_threads
        self.namespace = namespace
        self.start_timeout_s = start_timeout_s
        self.replicas: dict[str, Replica] = {}
        self._ids = itertools.count()

    def _options(self, replica_id: str) -> dict:
        opts = {
            "num_cpus": self.resources.num_cpus,
            "num_gpus": self.resources.num_gpus,
            "max_concurrency": 1000,
            "max_restarts": 0,
            "name": replica_id,  # replica id == actor name, in the app's namespace
        }
        if self.namespace is not None:
            opts["namespace"] = self.namespace
        if self.resources.resources:
            opts["resources"] = dict(self.resources.resources)
        if self.resources.num_gpus > 0:
            # Fail an NCCL op with an error instead of letting the watchdog kill the process.
            opts["runtime_env"] = {"env_vars": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}}
        return opts

    def start_replica(self) -> Replica:
        """Create one actor (non-blocking); call wait_ready before routing to it."""
        replica_id = f"{self.pool}-{next(self._ids)}"
        handle = self.remote_cls.options(**self._options(replica_id)).remote(
            replica_id,
            self.engine_config,
            transport_host=self.transport_host,
            transfer_timeout_s=self.transfer_timeout_s,
            torch_threads=self.torch_threads,
            namespace=self.namespace,
        )
        replica = Replica(replica_id, self.pool, handle)
        self.replicas[replica_id] = replica
        return replica

    def wait_ready(self, replicas: list[Replica], timeout_s: float | None = None) -> None:
        refs = [r.handle.ready.remote() for r in replicas]
        try:
            ray.get(refs, timeout=timeout_s or self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{self.pool} replicas not ready after {timeout_s or self.start_timeout_s:.0f} s "
                f"(is there a node with the requested resources?)"
            ) from None
        for r in replicas:
            r.ready = True

    def start(self, num_replicas: int) -> list[Replica]:
        replicas = [self.start_replica() for _ in range(num_replicas)]
        if replicas:
            self.wait_ready(replicas)
        return replicas

    def live_replicas(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready]

    def get(self, replica_id: str) -> Replica | None:
        return self.replicas.get(replica_id)

    def remove(self, replica_id: str, kill: bool = True) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is not None and kill:
            self.kill(replica)

    @staticmethod
    def kill(replica: Replica) -> None:
        """Shut a replica's actor down (blocking: call it off the event loop when serving)."""
        replica_id = replica.replica_id
        try:
            ray.get(replica.handle.shutdown.remote(), timeout=10)
        except Exception:
            logger.info("replica %s did not shut down cleanly", replica_id)
        try:
            ray.kill(replica.handle)
        except Exception:
            pass

    def stop(self) -> None:
        for replica_id in list(self.replicas):
            self.remove(replica_id)
