"""Driver-side API: start prefill and decode pools on a local or existing Ray cluster, keep
the router current, and submit requests. The frontends and the autoscaler build on it."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

from splitserve.cluster.config import EnginePoolConfig, ServeConfig
from splitserve.cluster.control.dispatcher import ACTOR_GONE, Dispatcher
from splitserve.cluster.control.membership import ReplicaInfo
from splitserve.cluster.control.worker_pool import Replica, WorkerPool
from splitserve.cluster.routing.router import DECODE, PREFILL, Router
from splitserve.cluster.scaling.policy import initial_replicas, replica_floor
from splitserve.decode.decode_worker import DecodeWorker
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.kvtransfer.handoff import StreamChunk
from splitserve.kvtransfer.poll_reply import PollReply
from splitserve.prefill.prefill_worker import PrefillWorker

logger = logging.getLogger(__name__)


def engine_config_for(cfg: ServeConfig, pool: EnginePoolConfig, model_dir: str) -> dict:
    device = cfg.device
    if device == "auto":
        device = "cuda" if pool.resources.num_gpus > 0 else "cpu"
    return {
        "model": model_dir,
        "block_size": cfg.block_size,
        "num_kv_blocks": pool.num_kv_blocks,
        "max_num_seqs": pool.max_num_seqs,
        "max_num_batched_tokens": pool.max_num_batched_tokens,
        "max_model_len": cfg.max_model_len,
        "dtype": cfg.dtype,
        "device": device,
    }


def _threads(pool: EnginePoolConfig) -> int:
    return pool.torch_threads or max(1, int(pool.resources.num_cpus))


class DisaggCluster:
    def __init__(
        self,
        cfg: ServeConfig,
        model_dir: str,
        poll_interval_s: float = 0.1,
        on_poll=None,
        on_drop=None,
        ingress_id: str | None = None,
    ):
        self.cfg = cfg
        self.model_dir = model_dir
        router = Router(cfg.router, block_size=cfg.block_size)
        # Each deployment's actors live in a namespace of their own, named by replica id, so
        # two deployments can share a Ray cluster.
        self.cluster_id = uuid.uuid4().hex[:8]
        self.namespace = f"splitserve-{self.cluster_id}"
        self.prefill_pool = WorkerPool(
            PREFILL,
            PrefillWorker,
            engine_config_for(cfg, cfg.prefill, model_dir),
            cfg.prefill.resources,
            transport_host=cfg.transport_host,
            transfer_timeout_s=cfg.kv_transfer_lease_s,
            torch_threads=_threads(cfg.prefill),
            namespace=self.namespace,
        )
        self.decode_pool = WorkerPool(
            DECODE,
            DecodeWorker,
            engine_config_for(cfg, cfg.decode, model_dir),
            cfg.decode.resources,
            transport_host=cfg.transport_host,
            transfer_timeout_s=cfg.kv_transfer_lease_s,
            torch_threads=_threads(cfg.decode),
            namespace=self.namespace,
        )
        self.pools = {PREFILL: self.prefill_pool, DECODE: self.decode_pool}
        self.dispatcher = Dispatcher(
            router,
            ingress_id=ingress_id,
            max_retries=cfg.max_retries,
            lease_s=cfg.kv_transfer_lease_s,
            layerwise=cfg.layerwise_transfer,
            request_timeout_s=cfg.request_timeout_s,
            poll_interval_s=poll_interval_s,
            on_poll=on_poll,
            on_drop=on_drop,
            on_dead=self._replica_dead,
        )
        # Replicas each pool should have: what it started with, moved by add_replicas and
        # drain_replica (scaling), but not by a replica that died -- that is lost capacity.
        self.expected_replicas = {PREFILL: 0, DECODE: 0}
        self._kills: set[asyncio.Task] = set()  # dead replicas being shut down off the event loop
        self.min_replicas = {
            PREFILL: replica_floor(cfg.prefill.replicas, cfg.prefill.autoscaling),
            DECODE: replica_floor(cfg.decode.replicas, cfg.decode.autoscaling),
        }

    @property
    def router(self) -> Router:
        """The dispatcher's router: the one object routing reads, replaced by restart_router."""
        return self.dispatcher.router

    async def restart_router(self) -> Router:
        """Replace the router with a fresh one (same config) indexed from every live replica's
        snapshot, as after a router crash; requests keep flowing during the swap."""
        return await self.dispatcher.rebuild_router(lambda: Router(self.cfg.router, block_size=self.cfg.block_size))

    async def start(self) -> None:
        for name, pool_cfg in ((PREFILL, self.cfg.prefill), (DECODE, self.cfg.decode)):
            num = initial_replicas(pool_cfg.replicas, pool_cfg.autoscaling)
            if num:
                await self.add_replicas(name, num)
        self.dispatcher.start_polling()

    async def add_replicas(self, pool: str, num: int = 1) -> list[Replica]:
        """Start replicas, wait until they load, index their snapshot, then route to them."""
        worker_pool = self.pools[pool]
        replicas = [worker_pool.start_replica() for _ in range(num)]
        try:
            await asyncio.to_thread(worker_pool.wait_ready, replicas)
        except BaseException:
            for r in replicas:
                worker_pool.remove(r.replica_id)
            raise
        for r in replicas:
            address = None
            if pool == DECODE:
                address = tuple(await asyncio.wait_for(r.handle.channel_address.remote(), 30))
            info = ReplicaInfo(pool, r.replica_id, self.namespace, channel_address=address)
            await self.dispatcher.add_replica(info, r.handle)
        self.expected_replicas[pool] += len(replicas)
        return replicas

    def _replica_dead(self, pool: str, replica_id: str, kill: bool) -> None:
        """The dispatcher found a replica dead (its actor, or its engine loop: kill shuts the
        actor down, in a thread since it blocks) and dropped it from routing."""
        replica = self.pools[pool].get(replica_id)
        self._forget_replica(pool, replica_id)
        if kill and replica is not None:
            task = asyncio.get_running_loop().create_task(asyncio.to_thread(WorkerPool.kill, replica))
            self._kills.add(task)
            task.add_done_callback(self._kills.discard)

    def _forget_replica(self, pool: str, replica_id: str) -> None:
        """A replica left routing (drained, or found dead): out of its pool, and its peers
        drop their process groups with it (either side may be the one leaving)."""
        self.pools[pool].remove(replica_id, kill=False)
        peer_pool = self.pools[DECODE if pool == PREFILL else PREFILL]
        for r in peer_pool.live_replicas():
            r.handle.forget_peer.remote(replica_id)

    async def drain_replica(self, pool: str, replica_id: str, timeout_s: float = 120.0) -> bool:
        """Stop routing to a replica, wait for its in-flight requests, then drop its index
        entries and remove it. Returns False if requests were still in flight at the timeout
        (it is removed anyway)."""
        self.dispatcher.set_draining(pool, replica_id, True)
        replica = self.pools[pool].get(replica_id)
        if replica is not None:
            self.expected_replicas[pool] -= 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        drained = replica is None
        while not drained and loop.time() < deadline:
            # The dispatcher's count covers requests routed here whose call has not arrived.
            drained = self.dispatcher.num_inflight(pool, replica_id) == 0 and await _is_idle(replica)
            if not drained:
                await asyncio.sleep(0.1)
        self.dispatcher.drop_replica(pool, replica_id)
        self._forget_replica(pool, replica_id)
        if replica is not None:
            await asyncio.to_thread(WorkerPool.kill, replica)  # blocking; keep streams flowing
        return drained

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        label: str | None = None,
        deadline: float | None = None,
        on_route=None,
    ) -> AsyncIterator[StreamChunk]:
        """The dispatcher's stream of the request's chunks (see Dispatcher.generate)."""
        return self.dispatcher.generate(prompt_token_ids, params, label, deadline, on_route)

    async def complete(self, prompt_token_ids: list[int], params: SamplingParams, label: str | None = None) -> dict:
        """Run one request to the end and collect it."""
        token_ids: list[int] = []
        text = []
        last = None
        async for chunk in self.generate(prompt_token_ids, params, label):
            token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        return {
            "token_ids": token_ids,
            "text": "".join(text),
            "finish_reason": last.finish_reason,
            "num_prompt_tokens": last.num_prompt_tokens,
            "num_cached_tokens": last.num_cached_tokens,
            "prefill_replica": last.prefill_replica,
            "request_id": last.request_id,
        }

    def live_replicas(self, pool: str) -> int:
        """Replicas of the pool that take new requests (routed, not draining)."""
        return len(self.router.replica_ids(pool, include_draining=False))

    async def poll_replica(self, pool: str, replica_id: str) -> PollReply:
        return PollReply.from_bytes(await self.pools[pool].get(replica_id).handle.poll.remote())

    async def shutdown(self) -> None:
        await self.dispatcher.close()
        for pool in self.pools.values():
            await asyncio.to_thread(pool.stop)


async def _is_idle(replica: Replica) -> bool:
    """The replica runs, queues, streams and pins nothing (a dead one is idle: nothing is left
    to wait for)."""
    try:
        data = await asyncio.wait_for(replica.handle.poll.remote(), 10)
    except ACTOR_GONE:
        return True
    except TimeoutError:
        return False
    return PollReply.from_bytes(data).is_idle
