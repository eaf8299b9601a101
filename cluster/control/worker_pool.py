"""A pool of prefill or decode Ray actors with a per-replica resource request.

Replicas are NAMED, DETACHED actors in the app's Ray namespace (`splitserve-<app>`), named
by their replica id (`prefill-3`, `decode-0`): they outlive the controller that started
them, and a restarted controller finds them again by name (adopt) -- same actors, no model
reload. Detached is not leaked: the controller's shutdown kills every one, and the CLI reaps
whatever named actor is left in the namespace (reap_namespace).

A request for `num_gpus` or a custom resource that no node has yet stays pending, which is
exactly what Ray's autoscaler (ray up / KubeRay) scales on.

A replica of tensor_parallel_size N > 1 is a gang (cluster/control/replica_gang.py): N rank
actors in one placement group, each asking the pool's per-replica resources; rank 0 is the
actor named by the replica id, its followers `<replica id>-rank-<r>`. TP 1 is one actor, as
before, with no placement group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from splitserve.cluster.config import EnginePoolConfig, PoolResources, ServeConfig
from splitserve.cluster.control.replica_gang import PLACEMENT_TIMEOUT_S, ReplicaGang
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.proto.messages.membership import ReplicaInfo
from splitserve.runtime.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


def app_namespace(app_name: str) -> str:
    """The Ray namespace holding an app's pool actors."""
    return f"splitserve-{app_name}"


def model_namespace(app_name: str, model_name: str) -> str:
    """The Ray namespace of one model's pool actors in a deployment of several models:
    `<app namespace>--<served name reduced to safe characters>-<hash of the exact name>`."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name).strip("_")[-48:] or "model"
    digest = hashlib.sha1(model_name.encode()).hexdigest()[:8]
    return f"{app_namespace(app_name)}--{slug}-{digest}"


def app_namespaces(app_name: str) -> list[str]:
    """Every namespace holding live named actors of the app: its own and each model's."""
    own = app_namespace(app_name)
    found = {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
    return sorted(ns for ns in found if ns == own or ns.startswith(own + "--"))


def named_actors(namespace: str) -> list[str]:
    """Names of the live named actors in a namespace (public, GCS-only API)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)


def reap_namespace(namespace: str) -> list[str]:
    """Kill every named actor left in the namespace (a controller that was force-killed
    cannot); returns their names."""
    killed = []
    for name in named_actors(namespace):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            killed.append(name)
        except ValueError:  # gone meanwhile
            pass
    return killed


@dataclass
class Replica:
    replica_id: str
    pool: str
    handle: Any
    started_at: float = field(default_factory=time.monotonic)
    draining: bool = False
    ready: bool = False
    ready_at: float | None = None  # monotonic: when it became routable
    actor_id: str = ""
    channel_address: tuple[str, int] | None = None
    gang: ReplicaGang | None = None  # tensor_parallel_size > 1: its ranks and placement group

    def info(self, namespace: str) -> ReplicaInfo:
        return ReplicaInfo(
            pool=self.pool,
            replica_id=self.replica_id,
            namespace=namespace,
            channel_address=self.channel_address,
            draining=self.draining,
            actor_id=self.actor_id,
            rank_nodes=tuple(self.gang.nodes) if self.gang is not None else (),
        )


class WorkerPool:
    def __init__(
        self,
        pool: str,
        worker_cls: type,
        worker: WorkerConfig,
        resources: PoolResources,
        start_timeout_s: float = 300.0,
    ):
        """worker: what every replica actor of the pool is built from (its namespace is the app's)."""
        if worker.namespace is None:
            raise ValueError(f"the {pool} pool's WorkerConfig needs the app's namespace")
        self.pool = pool
        self.remote_cls = ray.remote(worker_cls)
        # Its own copy of the engine config: what the pool's next replica starts with (a test
        # may change it to make starts fail).
        self.worker = dataclasses.replace(worker, engine_config=dict(worker.engine_config))
        self.resources = resources
        self.namespace: str = worker.namespace
        self.start_timeout_s = start_timeout_s
        self.replicas: dict[str, Replica] = {}
        self._ids = itertools.count()
        self._name = re.compile(rf"^{re.escape(pool)}-(\d+)$")
        self.tensor_parallel_size: int = worker.engine_config.get("tensor_parallel_size", 1)
        self.placement_timeout_s = PLACEMENT_TIMEOUT_S

    @property
    def engine_config(self) -> dict:
        return self.worker.engine_config

    def _options(self, replica_id: str) -> dict:
        opts = {
            "num_cpus": self.resources.num_cpus,
            "num_gpus": self.resources.num_gpus,
            "max_concurrency": 1000,
            "max_restarts": 0,
            "name": replica_id,  # replica id == actor name, in the app's namespace
            "namespace": self.namespace,
            "lifetime": "detached",  # outlives the controller; killed by its shutdown
        }
        if self.resources.resources:
            opts["resources"] = dict(self.resources.resources)
        if self.resources.num_gpus > 0:
            # Fail an NCCL op with an error instead of letting the watchdog kill the process.
            opts["runtime_env"] = {"env_vars": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}}
        return opts

    def start_replica(self) -> Replica:
        """Create one actor (non-blocking); wait for ready() before routing to it."""
        replica_id = f"{self.pool}-{next(self._ids)}"
        options, worker, gang = self._options(replica_id), self.worker, None
        if self.tensor_parallel_size > 1:
            from splitserve.runtime.tp_rank_actor import TensorParallelRankActor

            gang = ReplicaGang.create(
                self.pool,
                replica_id,
                self.namespace,
                self.resources,
                self.tensor_parallel_size,
                TensorParallelRankActor,
            )
            options["scheduling_strategy"] = gang.strategy(0)
            worker = dataclasses.replace(worker, tp_followers=tuple(gang.followers))
        handle = self.remote_cls.options(**options).remote(replica_id, worker)
        replica = Replica(replica_id, self.pool, handle, actor_id=handle._actor_id.hex(), gang=gang)
        self.replicas[replica_id] = replica
        return replica

    def start(self, num_replicas: int, timeout_s: float | None = None) -> list[Replica]:
        """Start replicas and wait until they loaded (blocking: tools and benchmarks; the
        controller waits without blocking)."""
        replicas = [self.start_replica() for _ in range(num_replicas)]
        try:
            ray.get([r.handle.ready.remote() for r in replicas], timeout=timeout_s or self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{self.pool} replicas not ready after {timeout_s or self.start_timeout_s:.0f} s"
            ) from None
        for r in replicas:
            self.mark_ready(r)
        return replicas

    def adopt(self) -> list[Replica]:
        """Find this pool's live actors in the namespace (left by a previous controller) and
        take them over, not yet ready: the caller checks them as it would new ones. New
        replica ids continue after the highest adopted one."""
        adopted = []
        for name in named_actors(self.namespace):
            match = self._name.match(name)
            if match is None or name in self.replicas:
                continue
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
            except ValueError:  # died since the listing
                continue
            replica = Replica(name, self.pool, handle, actor_id=handle._actor_id.hex())
            if self.tensor_parallel_size > 1:
                replica.gang = ReplicaGang.adopt(
                    self.pool, name, self.namespace, self.resources, self.tensor_parallel_size
                )
            self.replicas[name] = replica
            adopted.append(replica)
        numbers = [int(self._name.match(rid).group(1)) for rid in self.replicas]
        if numbers:
            self._ids = itertools.count(max(numbers) + 1)
        return adopted

    def mark_ready(self, replica: Replica, channel_address: tuple[str, int] | None = None) -> None:
        replica.ready, replica.ready_at = True, time.monotonic()
        replica.channel_address = channel_address

    def live_replicas(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready]

    def get(self, replica_id: str) -> Replica | None:
        return self.replicas.get(replica_id)

    def remove(self, replica_id: str, kill: bool = True) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is not None and kill:
            self.kill(replica)

    @staticmethod
    def kill(replica: Replica, graceful: bool = True) -> None:
        """End a replica's actor (blocking: call it off the event loop when serving).
        graceful: let it stop its engine loop and close its transport first."""
        if graceful:
            try:
                ray.get(replica.handle.shutdown.remote(), timeout=10)
            except Exception:
                logger.info("replica %s did not shut down cleanly", replica.replica_id)
        try:
            ray.kill(replica.handle, no_restart=True)
        except Exception:
            pass
        if replica.gang is not None:
            replica.gang.kill()

    def stop(self) -> None:
        for replica_id in list(self.replicas):
            self.remove(replica_id)


def engine_config_for(cfg: ServeConfig, pool: EnginePoolConfig, model_dir: str, hash_seed: str | None = None) -> dict:
    device = cfg.device
    if device == "auto":
        device = "cuda" if pool.resources.num_gpus > 0 else "cpu"
    async_scheduling = cfg.async_scheduling
    if async_scheduling is None and pool is cfg.prefill and not device.startswith("cuda"):
        # Unset, a CPU engine overlaps where its decode steps are scripted (engine/config.py,
        # async_scheduling_pays); a prefill replica's steps are prompt chunks, run eagerly.
        async_scheduling = False
    return {
        "model": model_dir,
        "block_size": cfg.block_size,
        "num_kv_blocks": pool.num_kv_blocks,
        "kv_cache_dtype": pool.kv_cache_dtype,
        "kv_cache_memory_bytes": pool.kv_cache_memory_bytes,
        "max_num_seqs": pool.max_num_seqs,
        "max_num_batched_tokens": pool.max_num_batched_tokens,
        "mixed_step_prefill_tokens": pool.mixed_step_prefill_tokens,
        "threaded_step_min_tokens": pool.threaded_step_min_tokens,
        "max_model_len": cfg.max_model_len,
        "dtype": cfg.dtype,
        "quantization": cfg.quantization,
        "device": device,
        "kv_offloading_size": cfg.kv_offloading_size,
        "async_scheduling": async_scheduling,
        # Only decode speculates; prefill replicas sample one token per request.
        "speculative": cfg.speculative.model_dump() if pool is cfg.decode else None,
        "grammar": cfg.grammar.model_dump(),
        "engine": pool.engine or cfg.engine,
        "profile": cfg.engine_profile,
        "speed_factor": cfg.speed_factor,
        "hash_seed": hash_seed,
        "tensor_parallel_size": pool.tensor_parallel_size,
        # Both pools hold the adapters: prefill computes the prompt's KV with them, decode the rest.
        "enable_lora": cfg.enable_lora,
        "lora_modules": dict(cfg.lora_modules) or None,
        "max_loras": cfg.max_loras,
        "max_lora_rank": cfg.max_lora_rank,
        "max_cpu_loras": cfg.max_cpu_loras,
    }


def pools_for(cfg: ServeConfig, model_dir: str, namespace: str, hash_seed: str | None = None) -> dict[str, WorkerPool]:
    """The prefill and decode pools a ServeConfig describes, in the app's namespace; hash_seed:
    their engines' block-hash seed (the model's name where the deployment serves several)."""
    from splitserve.decode.decode_worker import DecodeWorker
    from splitserve.prefill.prefill_worker import PrefillWorker

    pools = {}
    for name, worker_cls, pool_cfg in ((PREFILL, PrefillWorker, cfg.prefill), (DECODE, DecodeWorker, cfg.decode)):
        worker = WorkerConfig(
            engine_config=engine_config_for(cfg, pool_cfg, model_dir, hash_seed),
            namespace=namespace,
            transport_host=cfg.transport_host,
            transfer_timeout_s=cfg.kv_transfer_lease_s,
            torch_threads=pool_cfg.torch_threads or max(1, int(pool_cfg.resources.num_cpus)),
            state_push_interval_s=cfg.replica_state.push_interval_s,
            state_heartbeat_s=cfg.replica_state.heartbeat_s,
        )
        pools[name] = WorkerPool(name, worker_cls, worker, pool_cfg.resources)
    return pools
