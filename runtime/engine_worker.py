"""EngineWorker: what a prefill and a decode replica share -- an engine (EngineProtocol:
LLMEngine, or the SimulatedEngine) run by an EngineLoop thread, the replica's KV transport for
the pairs with the other pool, and the control methods the ingress calls on every replica
(ready, channel_address, poll, snapshot, forget_peer, shutdown, inject_fault) and the
controller's probe.

It lives in runtime/, the layer below both workers (prefill/ and decode/ never import each
other). Its KV data plane (kvtransfer/protocols.py's KVDataPlane) is the one its engine kind
declares (kvtransfer/data_plane.py's data_plane_for): the transport it opens here, and the
sender (prefill) or posted receives (decode) each worker makes from it, all come from that plane.

A replica whose engine loop stopped for good has released every block and fails every call
with EngineLoopStopped; its poll() and probe() then answer a PollReply with status
LOOP_STOPPED (and why), so the ingress drops it from routing at once and the controller
replaces it.

Plain classes: cluster/control/worker_pool.py wraps PrefillWorker and DecodeWorker with
ray.remote, which exposes these inherited async methods as actor methods.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_errors import EngineLoopStopped, LoraAdapterBusyError, LoraAdapterError
from splitserve.engine.engine_factory import build_engine
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.engine_protocol import EngineProtocol, LayerHookFactory
from splitserve.engine.fault_injector import StepFaults
from splitserve.kvtransfer.data_plane import data_plane_for, open_replica_transport
from splitserve.kvtransfer.protocols import KVDataPlane, KVTransportProtocol
from splitserve.proto.messages.kv_events import KVEvent
from splitserve.proto.messages.poll_reply import PollReply, ReplicaStatus, TransferTotals
from splitserve.proto.messages.request_channel import Submit
from splitserve.runtime.replica_channel_server import IngressConnection, ReplicaChannelServer
from splitserve.runtime.sigterm_drain import SigtermDrain
from splitserve.runtime.state_publisher import StatePublisher
from splitserve.runtime.tp_rank_actor import launch_rank_actors
from splitserve.runtime.worker_config import WorkerConfig


class EngineWorker:
    loop: EngineLoop  # set by start_loop, which each worker calls at the end of its constructor
    transport: KVTransportProtocol  # this replica's pairs with the other pool's replicas

    def __init__(self, replica_id: str, worker: WorkerConfig):
        config = EngineConfig(**worker.engine_config)
        if worker.torch_threads and config.engine == "real":
            import torch  # the real engine's: a simulated replica never imports torch

            torch.set_num_threads(worker.torch_threads)
        self.replica_id = replica_id
        self.namespace = worker.namespace
        # TP > 1: this actor is rank 0 of its gang, the pool created the other ranks' actors.
        launch = launch_rank_actors(list(worker.tp_followers)) if worker.tp_followers else None
        self.data_plane: KVDataPlane = data_plane_for(config)
        # Each follower rank moves its own KV heads: the plane's rank side runs beside its forward.
        self.engine: EngineProtocol = build_engine(config, launch, self.data_plane.follower_extension())
        self.host, self.transport = open_replica_transport(
            self.data_plane, worker.transport_host, replica_id, self.engine, worker.transfer_timeout_s
        )
        self.transfer_timeout_s = worker.transfer_timeout_s
        self.num_active = 0  # see PollReply.num_active
        # Recent KV events for the ingresses that follow this replica, each from its own
        # position (poll's since_seq); one that fell behind the log resyncs from snapshot().
        self.events: deque[KVEvent] = deque(maxlen=worker.event_log_size)
        self.publisher = StatePublisher(
            self._read_state, self.events_after, worker.state_push_interval_s, worker.state_heartbeat_s
        )
        self._channel: ReplicaChannelServer | None = None
        self._channel_lock = asyncio.Lock()
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self._last_state: PollReply | None = None
        self.sigterm = SigtermDrain(replica_id, self._on_sigterm)
        self.sigterm.install()

    def start_loop(self, layer_hook: LayerHookFactory | None = None, after_step=None, flush_outputs=None) -> None:
        """Start the engine thread; a subclass calls it once its own state (which the hooks
        read) exists."""
        self.loop = EngineLoop(
            self.engine, layer_hook=layer_hook, after_step=after_step, name=self.replica_id, flush_outputs=flush_outputs
        ).start()

    # ---- what a subclass reports ---------------------------------------------------------
    def num_pinned(self) -> int:
        """Loop thread: requests whose blocks wait for a peer (see PollReply.num_pinned)."""
        return 0

    def transfer_totals(self) -> TransferTotals:
        return TransferTotals()

    # ---- actor methods -------------------------------------------------------------------
    async def ready(self) -> str:
        await self.channel_address()
        return self.replica_id

    async def channel_address(self) -> tuple[str, int]:
        """Where ingresses connect (ReplicaInfo.channel_address): for pushed state, and on a
        decode replica for requests; the server starts on first call."""
        async with self._channel_lock:
            if self._channel is None:
                self.event_loop = asyncio.get_running_loop()  # the actor's: where channel writes happen
                channel = ReplicaChannelServer(self.replica_id, *self._request_callbacks(), self.publisher.subscribe)
                await channel.start(self.host)
                self._channel = channel
        assert self._channel.address is not None  # set by start()
        return self._channel.address

    def _request_callbacks(self) -> tuple[Callable[[IngressConnection, Submit], None] | None, Any, Any]:
        """(on_submit, on_abort, on_close) for the channel; a replica that takes no requests: None."""
        return None, None, None

    async def probe(self) -> bytes:
        """Load and health without KV events, for the controller (the events are the
        ingresses' routers', each following the log at its own sequence number)."""
        return await self.poll(None)

    async def poll(self, since_seq: int | None = None) -> bytes:
        """Load figures and, for a follower at since_seq, the KV events after it: a PollReply
        (with status LOOP_STOPPED once the engine loop stopped for good). since_seq None (the
        controller's probe) asks for no events. Events older than the log are gone: the
        follower sees a sequence gap and resyncs from snapshot()."""

        state = await self._read_state()
        if since_seq is not None and state.is_serving:
            state = msgspec.structs.replace(state, events=self.events_after(since_seq))
        return state.to_bytes()

    async def _read_state(self) -> PollReply:
        """Load and health (no events), having moved the engine's new KV events into the log."""

        def collect(engine: EngineProtocol):
            self.events.extend(engine.take_events())  # the one reader of the engine's events
            return engine.stats(), self.num_pinned()

        try:
            stats, num_pinned = await asyncio.wrap_future(self.loop.call(collect))
        except EngineLoopStopped:
            return await self._stopped_reply()
        self._last_state = PollReply(
            events=[],
            engine=stats,
            num_pinned=num_pinned,
            num_active=self.num_active,
            transfer=self.transfer_totals(),
            terminating=self.sigterm.requested,
        )
        return self._last_state

    def _on_sigterm(self) -> None:
        """The first SIGTERM (signal handler's thread): the controller hears of it at once,
        from the last state read, without waiting for the engine loop (a long step)."""
        if self.event_loop is not None and self._last_state is not None:
            state = msgspec.structs.replace(self._last_state, terminating=True)
            self.event_loop.call_soon_threadsafe(self.publisher.push_state_now, state)

    def events_after(self, since_seq: int | None) -> list[KVEvent]:
        if since_seq is None or not self.events or self.events[-1].seq <= since_seq:
            return []
        first = self.events[0].seq  # consecutive in the log: index by offset
        return list(itertools.islice(self.events, max(since_seq + 1 - first, 0), None))

    async def _stopped_reply(self) -> PollReply:
        """A dead replica's poll reply: its engine's stats after the loop released everything."""
        return PollReply(
            events=[],
            engine=await asyncio.to_thread(self.loop.final_stats),
            num_pinned=0,  # released with everything else
            num_active=self.num_active,
            transfer=self.transfer_totals(),
            status=ReplicaStatus.LOOP_STOPPED,
            error=self.loop.stop_reason,
        )

    async def snapshot(self) -> tuple[int, list[int]]:
        return await asyncio.wrap_future(self.loop.call(lambda engine: engine.snapshot()))

    async def forget_peer(self, peer_id: str, epoch: int | None = None) -> None:
        """The peer replica left, or closed its side of the pair (epoch: the one it closed; a
        newer pair is kept): close ours too, so nothing waits on it until the timeout."""
        await asyncio.to_thread(self.transport.close_pair, peer_id, epoch)

    async def load_lora_adapter(self, name: str, path: str) -> str | None:
        """Serve another LoRA adapter (the controller's runtime load): None once loaded, else
        the engine's one-line refusal (nothing changed). Runs on the engine loop between steps."""
        try:
            await asyncio.wrap_future(self.loop.call(lambda engine: engine.load_lora_adapter(name, path)))
        except LoraAdapterError as exc:
            return str(exc)
        return None

    async def unload_lora_adapter(self, name: str) -> tuple[bool, str] | None:
        """Stop serving a LoRA adapter: None once unloaded, else (busy, why): busy while
        requests here still use it (the controller retries), not busy if it is not served."""
        try:
            await asyncio.wrap_future(self.loop.call(lambda engine: engine.unload_lora_adapter(name)))
        except LoraAdapterBusyError as exc:
            return True, str(exc)
        except LoraAdapterError as exc:
            return False, str(exc)
        return None

    async def inject_fault(self, skip_state_frames: int = 0, **step_faults) -> None:
        """Chaos testing, in the engine loop's real code paths: step_faults are StepFaults'
        fields (engine/fault_injector.py: fail, hang or hold steps mid-forward, or stop the
        loop for good); the next skip_state_frames pushed state frames reach no subscriber (as
        for one that fell behind). Each call sets every fault (what it does not name is off)."""
        self.loop.inject_faults(StepFaults(**step_faults))
        self.publisher.frames_to_skip = skip_state_frames

    async def holding(self) -> bool:
        """Chaos testing: whether a step is held now (StepFaults.hold_at_output_tokens), i.e.
        every sequence running here has its output length and none waits to join."""
        return self.loop.holding

    async def process_id(self) -> int:
        """The worker process's pid (operators and tests signal it: runtime/sigterm_drain.py)."""
        return os.getpid()

    async def shutdown(self) -> None:
        await self.publisher.stop()
        if self._channel is not None:
            await self._channel.close()
        self.loop.stop()
        self.transport.close()
