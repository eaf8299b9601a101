"""MembershipFollower: keeps one ingress's Dispatcher in step with the controller's view of
the pools.

It long-polls the controller's `membership(seen_version, ingress_id, report, wait_s)` (a
Serve handle call, or the in-process Controller's method), diffs each new view against what
the dispatcher routes to, and applies it: new replicas are indexed from their snapshot
before they get traffic (add_replica), draining flags are set, removed replicas are
dropped; the view's LoRA adapters go to on_view (the ModelCatalog). Each call carries this ingress's report (IngressReport: in-flight requests per
replica, recent latencies, and about once a second its Prometheus samples) and the version
it has APPLIED, which is what the controller's drain waits on.

If the controller is unreachable (it died; Serve restarts it), the ingress keeps routing by
the last view it applied, and the replicas' KV events keep reaching its router directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from splitserve.cluster.ingress.dispatcher import Dispatcher
from splitserve.proto.messages.membership import MembershipView, ReplicaInfo

logger = logging.getLogger(__name__)

# (seen_version, ingress_id, report bytes | None, wait_s) -> view bytes | None
Fetch = Callable[[int, str, "bytes | None", float], Awaitable["bytes | None"]]


class MembershipFollower:
    def __init__(
        self,
        fetch: Fetch,
        dispatcher: Dispatcher,
        ingress_id: str | None = None,
        make_report: Callable[[], bytes | None] | None = None,
        wait_s: float = 1.0,
        call_timeout_s: float = 10.0,
        retry_s: float = 0.5,
        drain_wait_s: float | None = None,
    ):
        """wait_s: the long poll's wait (how fresh the controller's view of this ingress's
        in-flight requests is: the autoscaler's load); drain_wait_s: the wait while a draining
        replica still has requests of this ingress, whose end the drain waits to see (default:
        wait_s). A new view answers a call at once either way."""
        self.fetch = fetch
        self.dispatcher = dispatcher
        self.ingress_id = ingress_id or f"ingress-{uuid.uuid4().hex[:8]}"
        self.make_report = make_report
        self.wait_s = wait_s
        self.drain_wait_s = wait_s if drain_wait_s is None else drain_wait_s
        self.call_timeout_s = call_timeout_s
        self.retry_s = retry_s
        self.view: MembershipView | None = None  # the last view applied in full
        # Told every view as it is applied (the ingress's ModelCatalog takes its LoRA adapters).
        self.on_view: Callable[[MembershipView], None] | None = None
        self.applied_version = -1
        self.last_contact: float | None = None  # monotonic: the controller's last answer
        self.incomplete = False  # the last view could not be applied in full (retried)
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    async def sync(self, wait_s: float = 0.0) -> bool:
        """One call to the controller; apply its view if it sent one. True: a view was applied."""
        async with self._lock:
            report = self.make_report() if self.make_report is not None else None
            data = await asyncio.wait_for(
                self.fetch(self.applied_version, self.ingress_id, report, wait_s), self.call_timeout_s + wait_s
            )
            self.last_contact = time.monotonic()
            if data is None:
                return False
            return await self.apply(MembershipView.from_bytes(data))

    async def apply(self, view: MembershipView) -> bool:
        """Make the dispatcher route by `view`. Drops and draining flags first (they only
        take traffic away), then the adds. A replica whose add failed for a reason other
        than its death keeps the version unapplied, so the next call brings the view again."""
        if self.on_view is not None:
            self.on_view(view)
        wanted = {(r.pool, r.replica_id): r for r in view.replicas}
        current = self.dispatcher.replica_infos()
        for pool, replica_id in current.keys() - wanted.keys():
            self.dispatcher.drop_replica(pool, replica_id)
        for key, info in wanted.items():
            replica = current.get(key)
            if replica is not None and info.actor_id and replica.actor_id and replica.actor_id != info.actor_id:
                self.dispatcher.drop_replica(*key)  # the same name, a new actor
            elif replica is not None and replica.draining != info.draining:
                self.dispatcher.set_draining(info.pool, info.replica_id, info.draining)
        adds = [info for key, info in wanted.items() if key not in self.dispatcher.replica_infos()]
        results = await asyncio.gather(*(self._add(info) for info in adds))
        complete = all(results)
        if complete:
            self.view, self.applied_version = view, view.version
        self.incomplete = not complete
        return complete

    async def _add(self, info: ReplicaInfo) -> bool:
        try:
            added = await self.dispatcher.add_replica(info)
        except Exception as exc:
            logger.warning("cannot add %s replica %s yet: %r", info.pool, info.replica_id, exc)
            return False
        if not added:
            logger.info("%s replica %s is gone; not routing to it", info.pool, info.replica_id)
        return True  # a dead replica is applied as "not routed"

    async def wait_for_view(self, timeout_s: float) -> MembershipView:
        """Until the first view is applied (an ingress starting up); TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.view is None:
            try:
                await self.sync()
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no pool membership from the controller after {timeout_s:.0f} s: {exc!r}"
                    ) from None
                await asyncio.sleep(self.retry_s)
            else:
                if self.view is None and time.monotonic() > deadline:
                    raise TimeoutError(f"the controller's pool membership did not apply within {timeout_s:.0f} s")
        return self.view

    async def _run(self) -> None:
        while True:
            try:
                await self.sync(self._poll_wait())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the controller is restarting: keep the last view
                logger.debug("membership call failed: %r", exc)
                await asyncio.sleep(self.retry_s)
            else:
                if self.incomplete:  # not a tight loop of failing adds
                    await asyncio.sleep(self.retry_s)

    def _poll_wait(self) -> float:
        """Each call is a Serve handle call with a report, work for the serving ingress and the
        controller: with 0.25 s calls under load the controller used ~30% more CPU (10-53%) at c32
        (bench/results/vs_vllm_bench.md). So the ingress reports often only where a drain
        waits on it."""
        view = self.view
        if view is not None and self.drain_wait_s < self.wait_s:
            draining = {r.replica_id for r in view.replicas if r.draining}
            if draining and not draining.isdisjoint(self.dispatcher.inflight_counts()):
                return self.drain_wait_s
        return self.wait_s

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="membership-follower")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
