"""Routes requests to a (prefill, decode) pair, streams the result back, retries safely, and
keeps the router's view of every replica current by polling KV events and load. Which
replicas exist is the controller's to say: a MembershipFollower applies its views here
(add_replica, drop_replica, set_draining); a replica found dead leaves routing at once."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import ray

from splitserve.cluster.control.membership import ReplicaInfo
from splitserve.cluster.control.worker_pool import Replica
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.router import DECODE, PREFILL, NoReplicaError, Router
from splitserve.decode.decode_worker import PrefillFailedError, PrefillReplicaDeadError, ReplicaBusyError
from splitserve.engine.engine_errors import EngineLoopStopped
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.kvtransfer.handoff import DecodeRequest, StreamChunk
from splitserve.kvtransfer.poll_reply import PollReply

logger = logging.getLogger(__name__)
ACTOR_GONE = (ray.exceptions.RayActorError,)
# The replica called is dead: its actor died, or its engine loop stopped for good.
REPLICA_GONE = (EngineLoopStopped, *ACTOR_GONE)


_CLOCK_SLACK_S = 0.1  # timers may fire a little before the wall-clock deadline


def deadline_exceeded(timeout_s: float) -> RequestError:
    """The request ran past its deadline; whatever it held on the replicas is freed."""
    return RequestError(
        ErrorKind.DEADLINE, f"the request did not finish before its deadline ({timeout_s:.1f} s after it started)"
    )


class Dispatcher:
    def __init__(
        self,
        router: Router,
        max_retries: int = 1,
        layerwise: bool = True,
        lease_s: float = 20.0,
        request_timeout_s: float = 600.0,
        poll_interval_s: float = 0.1,
        on_poll: Callable[[str, str, PollReply], None] | None = None,
        on_drop: Callable[[str, str], None] | None = None,
    ):
        self.router = router
        # pool -> replica id -> Replica (its actor handle): what this ingress routes to, as the
        # MembershipFollower applies the controller's views (add_replica, drop_replica,
        # set_draining).
        self.replicas: dict[str, dict[str, Replica]] = {PREFILL: {}, DECODE: {}}
        self.max_retries = max_retries
        self.layerwise = layerwise
        self.lease_s = lease_s
        self.request_timeout_s = request_timeout_s
        self.poll_interval_s = poll_interval_s
        self.on_poll = on_poll
        self.on_drop = on_drop  # (pool, replica id) once a replica left routing, for any reason
        self.inflight: dict[str, str] = {}  # request id -> decode replica id
        self.inflight_prefill: dict[str, str] = {}  # request id -> prefill replica id, until its first token
        self._poller: asyncio.Task | None = None
        # Held while the router's view is read from the replicas (poll, add, rebuild), so a
        # rebuilt router never misses the events taken between a snapshot and the swap.
        self._membership = asyncio.Lock()
        # Actors found dead here before the controller's view dropped them: not re-added.
        self._dead_actors: set[str] = set()
        self.num_retries = 0

    # ---- replica membership (driven by the MembershipFollower) ------------------------------
    async def add_replica(self, info: ReplicaInfo, handle=None) -> bool:
        """Index a replica from its snapshot, then route to it. handle: its actor (None: looked
        up by name in info.namespace). False: its actor is gone (the controller's next view
        drops it)."""
        if info.actor_id and info.actor_id in self._dead_actors:
            return False
        if handle is None:
            try:
                handle = await asyncio.to_thread(ray.get_actor, info.replica_id, namespace=info.namespace)
            except ValueError:  # no such actor: it died
                return False
        replica = Replica(
            info.replica_id, info.pool, handle, draining=info.draining, ready=True, actor_id=info.actor_id
        )
        replica.channel_address = info.channel_address
        async with self._membership:
            try:
                seq, hashes = await asyncio.wait_for(handle.snapshot.remote(), 30)
            except ACTOR_GONE:
                return False
            if info.replica_id in self.router.replica_ids(info.pool):  # a rebuild or an older add got it
                self.router.resync(info.pool, info.replica_id, (seq, hashes))
            else:
                self.router.add_replica(info.pool, info.replica_id, (seq, hashes))
            self.router.set_draining(info.pool, info.replica_id, info.draining)
            self.replicas[info.pool][info.replica_id] = replica
        return True

    def drop_replica(self, pool: str, replica_id: str) -> None:
        """Stop routing to a replica and forget its index entries (unknown ids are ignored).
        Routing only: the controller kills replicas and tells their peers."""
        self.router.remove_replica(pool, replica_id)
        if self.replicas[pool].pop(replica_id, None) is not None and self.on_drop is not None:
            self.on_drop(pool, replica_id)

    def set_draining(self, pool: str, replica_id: str, draining: bool) -> None:
        """A draining replica gets no new requests; its in-flight ones finish."""
        replica = self.replicas[pool].get(replica_id)
        if replica is not None:
            replica.draining = draining
            self.router.set_draining(pool, replica_id, draining)

    def replica_infos(self) -> dict[tuple[str, str], Replica]:
        return {(pool, rid): r for pool, replicas in self.replicas.items() for rid, r in replicas.items()}

    def _drop_dead(self, pool: str, replica: Replica, why: str) -> None:
        """A replica found dead here leaves routing at once, before the controller notices."""
        logger.warning("%s replica %s %s; dropping it from routing", pool, replica.replica_id, why)
        if replica.actor_id:
            self._dead_actors.add(replica.actor_id)
        self.drop_replica(pool, replica.replica_id)

    async def rebuild_router(self, make_router: Callable[[], Router]) -> Router:
        """Swap in a fresh router indexed from every live replica's snapshot (a router
        restart), while requests keep flowing. Polling pauses until the swap, so events taken
        afterwards continue each replica's snapshot (older ones are skipped as duplicates).
        A replica that died meanwhile is dropped; draining flags carry over."""
        async with self._membership:
            router = make_router()
            live = [(pool_name, r) for pool_name, replicas in self.replicas.items() for r in list(replicas.values())]
            snapshots = await asyncio.gather(
                *(asyncio.wait_for(r.handle.snapshot.remote(), 30) for _, r in live), return_exceptions=True
            )
            for (pool_name, replica), snapshot in zip(live, snapshots):
                if isinstance(snapshot, REPLICA_GONE):  # its actor or its engine loop is dead
                    self._drop_dead(pool_name, replica, "is dead")
                elif isinstance(snapshot, BaseException):
                    raise RequestError(
                        ErrorKind.UNAVAILABLE,
                        f"cannot rebuild the router: snapshot of {replica.replica_id} failed: {_short(snapshot)}",
                    )
                elif self.replicas[pool_name].get(replica.replica_id) is replica:  # not removed meanwhile
                    router.add_replica(pool_name, replica.replica_id, snapshot)
                    router.set_draining(pool_name, replica.replica_id, replica.draining)
            self.router = router  # no await since the checks above: atomic on the event loop
            logger.info("router rebuilt from %d replica snapshots", len(live))
            return router

    def num_inflight(self, pool: str, replica_id: str) -> int:
        """Requests sent to a replica that still need it: on decode until they finish, on
        prefill until their first token (the KV has then been moved). Drain waits on it,
        which also covers a request routed there whose call has not reached the replica yet."""
        table = self.inflight if pool == DECODE else self.inflight_prefill
        return sum(1 for rid in list(table.values()) if rid == replica_id)

    def inflight_counts(self) -> dict[str, int]:
        """replica id -> num_inflight, for every replica with requests (both pools)."""
        counts: dict[str, int] = {}
        for table in (self.inflight, self.inflight_prefill):
            for replica_id in list(table.values()):
                counts[replica_id] = counts.get(replica_id, 0) + 1
        return counts

    # ---- polling -------------------------------------------------------------------------
    async def poll_once(self) -> None:
        async with self._membership:
            tasks = [
                self._poll_replica(pool_name, replica)
                for pool_name, replicas in self.replicas.items()
                for replica in list(replicas.values())
                if replica.replica_id in self.router.replica_ids(pool_name)
            ]
            if tasks:
                await asyncio.gather(*tasks)

    async def _poll_replica(self, pool: str, replica: Replica) -> None:
        rid = replica.replica_id
        try:
            poll = PollReply.from_bytes(await asyncio.wait_for(replica.handle.poll.remote(), 10))
        except ACTOR_GONE:
            self._drop_dead(pool, replica, "died")
            return
        except (TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning("polling %s failed: %r", rid, exc)
            return
        if rid not in self.router.replica_ids(pool):  # drained and dropped while we waited
            return
        if not poll.is_serving:  # it reported itself dead: out of routing now (the controller replaces it)
            self._drop_dead(pool, replica, f"stopped serving ({poll.error})")
            return
        if not self.router.apply_events(pool, rid, poll.events):
            if rid in self.router.replicas_needing_resync(pool):
                seq, hashes = await asyncio.wait_for(replica.handle.snapshot.remote(), 10)
                self.router.resync(pool, rid, (seq, hashes))
        self.router.update_load(pool, rid, LoadReport.from_poll(poll))
        if self.on_poll is not None:
            self.on_poll(pool, rid, poll)

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
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
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        deadline: float | None = None,
        on_route: Callable | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Stream a request's chunks. Retries (at most max_retries times, on other replicas)
        only while no chunk has reached the caller; raises RequestError (kind DEADLINE once
        `deadline` (time.time(); default now + request_timeout_s) passes, after which the
        replicas free whatever the request held)."""
        request_id = request_id or uuid.uuid4().hex
        deadline = deadline or time.time() + self.request_timeout_s
        timeout_s = deadline - time.time()
        exclude_p: set[str] = set()
        exclude_d: set[str] = set()
        attempt = 0
        num_budgeted = 0  # retries that count against max_retries
        while True:
            if time.time() >= deadline:
                raise deadline_exceeded(timeout_s)
            try:
                decision = self.router.route(prompt_token_ids, exclude_prefill=exclude_p, exclude_decode=exclude_d)
            except NoReplicaError as exc:
                raise RequestError(ErrorKind.UNAVAILABLE, str(exc)) from None
            if on_route is not None:
                on_route(decision)
            decode = self.replicas[DECODE].get(decision.decode_replica)
            prefill = None if decision.prefill_replica is None else self.replicas[PREFILL].get(decision.prefill_replica)
            if decode is None:  # removed since the router last heard of it
                exclude_d.add(decision.decode_replica)
                continue
            if decision.prefill_replica is not None and prefill is None:
                exclude_p.add(decision.prefill_replica)
                continue
            req = DecodeRequest(
                request_id=f"{request_id}#{attempt}" if attempt else request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=params.to_dict(),
                layerwise=self.layerwise,
                lease_s=self.lease_s,
                deadline=deadline,
            )
            gen = decode.handle.generate.options(num_returns="streaming").remote(
                req.to_bytes(),
                None if prefill is None else prefill.handle,
                None if prefill is None else prefill.replica_id,
            )
            self.inflight[request_id] = decode.replica_id
            if prefill is not None:
                self.inflight_prefill[request_id] = prefill.replica_id
            sent_any = done = False
            try:
                while True:
                    try:  # a replica that hangs must not hang the request past its deadline
                        data = await asyncio.wait_for(_next_item(gen), max(deadline - time.time(), 0.001))
                    except TimeoutError as exc:  # ours, or the replica's at the same deadline
                        if time.time() >= deadline - _CLOCK_SLACK_S:
                            raise deadline_exceeded(timeout_s) from None
                        raise RequestError(ErrorKind.UNAVAILABLE, f"request failed: {_short(exc)}") from None
                    if data is None:
                        raise RequestError(ErrorKind.INTERNAL, "decode stream ended without finishing")
                    chunk = StreamChunk.from_bytes(data)
                    sent_any = True
                    self.inflight_prefill.pop(request_id, None)
                    done = chunk.finished
                    yield chunk
                    if done:
                        return
            except (PrefillFailedError, ReplicaBusyError, *REPLICA_GONE) as exc:
                if time.time() >= deadline:
                    raise deadline_exceeded(timeout_s) from None
                # A dead replica is no fault of the request: excluded, it costs no retry (the
                # pools are finite, so this ends).
                replica_dead = isinstance(exc, (PrefillReplicaDeadError, *REPLICA_GONE))
                # Never after a chunk reached the caller: a retry cannot resume it exactly.
                if sent_any or (num_budgeted >= self.max_retries and not replica_dead):
                    busy = isinstance(exc, (ReplicaBusyError, *REPLICA_GONE))
                    kind = ErrorKind.UNAVAILABLE if busy else ErrorKind.INTERNAL
                    raise RequestError(kind, f"request failed: {_short(exc)}") from None
                attempt += 1
                num_budgeted += not replica_dead
                self.num_retries += 1
                if isinstance(exc, (ReplicaBusyError, *REPLICA_GONE)) or prefill is None:
                    exclude_d.add(decode.replica_id)  # the decode replica is gone or full
                else:
                    exclude_p.add(prefill.replica_id)
                logger.warning("retrying %s (attempt %d) after: %s", request_id, attempt, _short(exc))
            except ValueError as exc:  # InvalidRequestError raised inside the replica
                raise RequestError(ErrorKind.INVALID, str(exc)) from None
            except ray.exceptions.RayError as exc:  # any other replica-side failure: say so
                raise RequestError(ErrorKind.INTERNAL, f"request failed: {_short(exc)}") from None
            finally:
                self.inflight.pop(request_id, None)
                self.inflight_prefill.pop(request_id, None)
                if not done:
                    _cancel(gen)


async def _next_item(gen) -> bytes | None:
    """The next item of a streaming actor call, or None at its end."""
    try:
        ref = await gen.__anext__()
    except StopAsyncIteration:
        return None
    return await ref


def _cancel(gen) -> None:
    try:
        ray.cancel(gen)
    except Exception:
        pass


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
