"""Routes requests to a (prefill, decode) pair, streams the result back, retries safely, and
keeps the router's view of every replica current by polling KV events and load."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import ray

from cluster.router import DECODE, PREFILL, NoReplicaError, Router
from cluster.worker_pool import Replica, WorkerPool
from decode.decode_worker import PrefillFailedError, ReplicaBusyError
from engine.sampling_params import SamplingParams
from kvtransfer.handoff import DecodeRequest, StreamChunk

logger = logging.getLogger(__name__)
ACTOR_GONE = (ray.exceptions.RayActorError,)


class RequestFailedError(RuntimeError):
    """The request could not be served; status is the HTTP status a frontend should use."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class Dispatcher:
    def __init__(self, router: Router, prefill_pool: WorkerPool | None, decode_pool: WorkerPool,
                 max_retries: int = 1, layerwise: bool = True, lease_s: float = 20.0,
                 request_timeout_s: float = 600.0, poll_interval_s: float = 0.1,
                 on_poll: Callable[[str, str, dict], None] | None = None, idle_pair_s: float = 300.0):
        self.router = router
        self.pools = {PREFILL: prefill_pool, DECODE: decode_pool}
        self.max_retries = max_retries
        self.layerwise = layerwise
        self.lease_s = lease_s
        self.request_timeout_s = request_timeout_s
        self.poll_interval_s = poll_interval_s
        self.on_poll = on_poll
        self.idle_pair_s = idle_pair_s
        self.inflight: dict[str, str] = {}          # request id -> decode replica id
        self._poller: asyncio.Task | None = None
        self.num_retries = 0

    # ---- replica membership --------------------------------------------------------------
    async def add_replica(self, replica: Replica) -> None:
        """Index a ready replica from its snapshot before it gets any traffic."""
        seq, hashes = await asyncio.wait_for(replica.handle.snapshot.remote(), 30)
        self.router.add_replica(replica.pool, replica.replica_id, (seq, hashes))

    def drop_replica(self, pool: str, replica_id: str, kill: bool = False) -> None:
        self.router.remove_replica(pool, replica_id)
        worker_pool = self.pools.get(pool)
        if worker_pool is not None:
            worker_pool.remove(replica_id, kill=kill)
        if pool == PREFILL:  # decode replicas drop their process groups with it
            for r in self.pools[DECODE].live_replicas():
                r.handle.forget_peer.remote(replica_id)

    # ---- polling -------------------------------------------------------------------------
    async def poll_once(self) -> None:
        tasks = []
        for pool_name, pool in self.pools.items():
            if pool is None:
                continue
            for replica in list(pool.live_replicas()):
                if replica.replica_id in self.router.replica_ids(pool_name):
                    tasks.append(self._poll_replica(pool_name, replica))
        if tasks:
            await asyncio.gather(*tasks)

    async def _poll_replica(self, pool: str, replica: Replica) -> None:
        rid = replica.replica_id
        try:
            state = await asyncio.wait_for(replica.handle.poll.remote(), 10)
        except ACTOR_GONE:
            logger.warning("%s replica %s died; dropping it from routing", pool, rid)
            self.drop_replica(pool, rid)
            return
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning("polling %s failed: %r", rid, exc)
            return
        if not self.router.apply_events(pool, rid, state["events"]):
            if rid in self.router.replicas_needing_resync(pool):
                seq, hashes = await replica.handle.snapshot.remote()
                self.router.resync(pool, rid, (seq, hashes))
        load = state["load"]
        self.router.update_load(pool, rid, queued_prefill_tokens=load["num_waiting_tokens"],
                                num_running=load["num_running"] + load.get("num_active", 0),
                                kv_usage=load["kv_usage"], num_waiting=load["num_waiting"])
        if self.on_poll is not None:
            self.on_poll(pool, rid, state)

    async def close_idle_pairs(self, max_idle_s: float) -> None:
        """Decode replicas drop process groups idle for max_idle_s; their prefill peers follow."""
        for decode in list(self.pools[DECODE].live_replicas()):
            try:
                closed = await asyncio.wait_for(decode.handle.close_idle_pairs.remote(max_idle_s), 30)
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                continue
            for prefill_id in closed:
                prefill = self.pools[PREFILL].get(prefill_id) if self.pools[PREFILL] else None
                if prefill is not None:
                    prefill.handle.forget_peer.remote(decode.replica_id)

    async def _poll_forever(self) -> None:
        last_idle_sweep = time.monotonic()
        while True:
            try:
                await self.poll_once()
                if time.monotonic() - last_idle_sweep > self.idle_pair_s / 4:
                    last_idle_sweep = time.monotonic()
                    await self.close_idle_pairs(self.idle_pair_s)
            except Exception:
                logger.exception("replica poll failed")
            await asyncio.sleep(self.poll_interval_s)

    def start_polling(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None

    # ---- requests ------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, deadline: float | None = None,
                       on_route: Callable | None = None) -> AsyncIterator[StreamChunk]:
        request_id = request_id or uuid.uuid4().hex
        deadline = deadline or time.time() + self.request_timeout_s
        exclude_p: set[str] = set()
        exclude_d: set[str] = set()
        attempt = 0
        while True:
            try:
                decision = self.router.route(prompt_token_ids, exclude_prefill=exclude_p, exclude_decode=exclude_d)
            except NoReplicaError as exc:
                raise RequestFailedError(str(exc), status=503) from None
            if on_route is not None:
                on_route(decision)
            decode = self.pools[DECODE].get(decision.decode_replica)
            prefill = None if decision.prefill_replica is None else self.pools[PREFILL].get(decision.prefill_replica)
            if decode is None or (decision.prefill_replica is not None and prefill is None):
                exclude_d.add(decision.decode_replica)
                continue
            req = DecodeRequest(request_id=f"{request_id}#{attempt}" if attempt else request_id,
                                prompt_token_ids=prompt_token_ids, sampling=params.to_dict(),
                                layerwise=self.layerwise, lease_s=self.lease_s, deadline=deadline)
            gen = decode.handle.generate.options(num_returns="streaming").remote(
                req.to_bytes(), None if prefill is None else prefill.handle,
                None if prefill is None else prefill.replica_id)
            self.inflight[request_id] = decode.replica_id
            sent_any = done = False
            try:
                async for ref in gen:
                    chunk = StreamChunk.from_bytes(await ref)
                    sent_any = True
                    done = chunk.finished
                    yield chunk
                    if done:
                        return
                raise RequestFailedError("decode stream ended without finishing", 500)
            except (PrefillFailedError, ReplicaBusyError, *ACTOR_GONE) as exc:
                failed_decode = isinstance(exc, ACTOR_GONE)
                if sent_any or attempt >= self.max_retries:
                    status = 503 if isinstance(exc, (ReplicaBusyError, *ACTOR_GONE)) else 500
                    raise RequestFailedError(f"request failed: {_short(exc)}", status) from None
                attempt += 1
                self.num_retries += 1
                if failed_decode:
                    exclude_d.add(decode.replica_id)
                elif prefill is not None:
                    exclude_p.add(prefill.replica_id)
                logger.warning("retrying %s (attempt %d) after: %s", request_id, attempt, _short(exc))
            except ValueError as exc:  # InvalidRequestError raised inside the replica
                raise RequestFailedError(str(exc), 400) from None
            finally:
                self.inflight.pop(request_id, None)
                if not done:
                    _cancel(gen)


def _cancel(gen) -> None:
    try:
        ray.cancel(gen)
    except Exception:
        pass


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
