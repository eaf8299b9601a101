"""DisaggCluster: one ingress's view of the pools -- a Dispatcher (router, request path, KV
event polling) fed by a MembershipFollower from the controller -- and, with no controller
given, the driver API that runs the Controller in-process (tests, the bench, tools).

An ingress replica passes a ControllerClient (the controller deployment's Serve handle);
everything else uses the in-process form, which goes through the very same membership
interface, so the actor-level tests exercise what the service runs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.controller import Controller
from splitserve.cluster.control.in_process_controller_client import InProcessControllerClient
from splitserve.cluster.control.worker_pool import Replica, WorkerPool
from splitserve.cluster.ingress.controller_client import METRICS_TIMEOUT_S, ControllerClient
from splitserve.cluster.ingress.dispatcher import Dispatcher
from splitserve.cluster.ingress.membership_follower import MembershipFollower
from splitserve.cluster.routing.batch_headroom import BatchHeadroom
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.cluster.scaling.policy import replica_floor
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.ingress_report import IngressReport
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.sampling_params import SamplingParams


class DisaggCluster:
    def __init__(
        self,
        cfg: ServeConfig,
        model_dir: str,
        poll_interval_s: float | None = None,
        on_poll=None,
        controller: ControllerClient | InProcessControllerClient | None = None,
        make_report: Callable[[dict[str, int]], bytes] | None = None,
        ingress_id: str | None = None,
        autoscale: bool = False,
        membership_wait_s: float = 1.0,
        membership_drain_wait_s: float = 0.25,
        on_drop: Callable[[str, str], None] | None = None,
        hash_seed: str | None = None,
    ):
        """controller: the controller deployment's client (an ingress replica); None: run a
        Controller here (autoscale: with its autoscaler). make_report(inflight) -> the
        IngressReport bytes sent with each membership call (default: in-flight counts only).
        on_poll(pool, replica id, PollReply) / on_drop(pool, replica id): this ingress applied a
        replica's state (polled or pushed) / stopped routing to one. poll_interval_s: overrides
        cfg.replica_state.poll_interval_s. hash_seed: the model's block-hash seed (its engines')."""
        self.cfg = cfg
        self.model_dir = model_dir
        # Names this ingress to the controller and prefixes its request ids (unique per ingress).
        ingress_id = ingress_id or uuid.uuid4().hex[:8]
        self.dispatcher = Dispatcher(
            self._new_router(hash_seed),
            ingress_id=ingress_id,
            max_retries=cfg.max_retries,
            lease_s=cfg.kv_transfer_lease_s,
            layerwise=cfg.layerwise_transfer,
            early_first_token=cfg.early_first_token,
            request_timeout_s=cfg.request_timeout_s,
            poll_interval_s=poll_interval_s or cfg.replica_state.poll_interval_s,
            on_poll=on_poll,
            on_drop=on_drop,
            state_updates=cfg.replica_state.updates,
            heartbeat_s=cfg.replica_state.heartbeat_s,
            max_migrations=cfg.migration.max_attempts,
        )
        self.client = controller
        self.controller: Controller | None = None
        if controller is None:
            # The actors' namespace carries a per-cluster id, so two can share a Ray cluster.
            self.cluster_id = uuid.uuid4().hex[:8]
            self.controller = Controller(
                cfg, model_dir, f"driver-{self.cluster_id}", autoscale=autoscale, hash_seed=hash_seed
            )
        self._make_report = make_report or (lambda inflight: IngressReport(inflight=inflight).to_bytes())
        fetch = self.controller.membership if self.controller is not None else controller.membership
        self.follower = MembershipFollower(
            fetch,
            self.dispatcher,
            ingress_id,
            make_report=lambda: self._make_report(self.dispatcher.inflight_counts()),
            wait_s=membership_wait_s,
            drain_wait_s=membership_drain_wait_s,
        )
        self.min_replicas = {
            PREFILL: replica_floor(cfg.prefill.replicas, cfg.prefill.autoscaling),
            DECODE: replica_floor(cfg.decode.replicas, cfg.decode.autoscaling),
        }

    # ---- what this ingress routes by -------------------------------------------------------
    @property
    def router(self) -> Router:
        """The dispatcher's router: the one object routing reads, replaced by restart_router."""
        return self.dispatcher.router

    @property
    def loads(self) -> Router:
        """This ingress's load view (replica_ids, load): what an Autoscaler driven from here reads."""
        return self.dispatcher.router

    @property
    def ingress_id(self) -> str:
        return self.follower.ingress_id

    @property
    def expected_replicas(self) -> dict[str, int]:
        """Each pool's target replica count, as the controller last said."""
        view = self.follower.view
        return dict(view.expected) if view is not None else {PREFILL: 0, DECODE: 0}

    def refilling(self, pool: str, starting: int = 0) -> bool:
        """The in-process controller is replacing replicas of the pool (see Controller.refilling)."""
        return self.controller is not None and self.controller.refilling(pool, starting)

    def live_replicas(self, pool: str) -> int:
        """Replicas of the pool that take new requests (routed, not draining)."""
        return len(self.router.replica_ids(pool, include_draining=False))

    # ---- the in-process controller's pools (driver API) ----------------------------------
    @property
    def pools(self) -> dict[str, WorkerPool]:
        return self._own_controller().pools

    @property
    def prefill_pool(self) -> WorkerPool:
        return self.pools[PREFILL]

    @property
    def decode_pool(self) -> WorkerPool:
        return self.pools[DECODE]

    def _own_controller(self) -> Controller:
        if self.controller is None:
            raise RuntimeError("the pools belong to the controller deployment, not to this ingress")
        return self.controller

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, membership_timeout_s: float = 600.0) -> None:
        """Start the in-process controller (if any), apply its first view, then follow it."""
        if self.controller is not None:
            await self.controller.start()
        await self.follower.wait_for_view(membership_timeout_s)
        self.follower.start()
        self.dispatcher.start_following()

    async def shutdown(self) -> None:
        await self.follower.stop()
        await self.dispatcher.close()
        if self.controller is not None:
            await self.controller.shutdown()

    async def restart_router(self) -> Router:
        """Replace the router with a fresh one (same config) indexed from every live replica's
        snapshot, as after a router crash; requests keep flowing during the swap."""
        seed = self.router.hash_seed
        return await self.dispatcher.rebuild_router(lambda: self._new_router(seed))

    def _new_router(self, hash_seed: str | None) -> Router:
        """The router of this model's pools; batch work goes only where there is headroom
        (priority.batch_max_kv_usage, batch_max_running_fraction of decode's max_num_seqs)."""
        priority = self.cfg.priority
        max_running = max(1, int(priority.batch_max_running_fraction * self.cfg.decode.max_num_seqs))
        headroom = BatchHeadroom(priority.batch_max_kv_usage, max_running)
        return Router(self.cfg.router, block_size=self.cfg.block_size, hash_seed=hash_seed, batch_headroom=headroom)

    async def add_replicas(self, pool: str, num: int = 1) -> list[Replica]:
        """Start replicas, wait until they load, index their snapshot, then route to them."""
        replicas = await self._own_controller().add_replicas(pool, num)
        await self._until_applied()
        return replicas

    async def load_lora_adapter(self, name: str, path: str) -> tuple[int, str]:
        """The controller loads a LoRA adapter on every replica: (HTTP status, message)."""
        return await (self.controller or self.client).load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str) -> tuple[int, str]:
        """The controller unloads a LoRA adapter from every replica: (HTTP status, message)."""
        return await (self.controller or self.client).unload_lora_adapter(name)

    async def drain_replica(self, pool: str, replica_id: str, timeout_s: float = 120.0) -> bool:
        """Stop routing to a replica, wait for its in-flight requests, then drop it and remove
        its actor. Returns False if requests were still in flight at the timeout (it is
        removed anyway)."""
        controller = self._own_controller()
        self.dispatcher.set_draining(pool, replica_id, True)  # here at once; the view follows
        drained = await controller.drain_replica(pool, replica_id, timeout_s)
        await self._until_applied()
        return drained

    async def _until_applied(self, timeout_s: float = 30.0) -> None:
        """This ingress routes by the in-process controller's current view."""
        deadline = time.monotonic() + timeout_s
        while self.follower.applied_version < self.controller.version and time.monotonic() < deadline:
            await self.follower.sync()

    # ---- requests ------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        label: str | None = None,
        deadline: float | None = None,
        on_route=None,
        exclude_decode=(),
        sheddable: bool = False,
        migrations=None,
    ) -> AsyncIterator[StreamChunk]:
        """The dispatcher's stream of the request's chunks (see Dispatcher.generate); label:
        the client's own id, only logged."""
        return self.dispatcher.generate(
            prompt_token_ids, params, label, deadline, on_route, exclude_decode, sheddable, migrations
        )

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

    async def poll_replica(self, pool: str, replica_id: str) -> PollReply:
        return PollReply.from_bytes(await self.dispatcher.members[pool][replica_id].handle.probe.remote())

    async def render_metrics(self, families: bytes) -> bytes:
        """The deployment's merged /metrics: every ingress's samples (this one's current
        `families`) and the controller's pool series."""
        if self.controller is not None:
            return self.controller.render_metrics(self.ingress_id, families)
        return await asyncio.wait_for(self.client.render_metrics(self.ingress_id, families), METRICS_TIMEOUT_S)
