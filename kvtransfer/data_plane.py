"""The KV data plane a worker's engine gets (protocols.py's KVDataPlane), chosen once by the
kind of engine its EngineConfig declares: `real` -> TorchDataPlane (pairs over
torch.distributed), `simulated` -> SimulatedDataPlane (timed waits). Each plane imports its
implementations only when used, so a simulated replica never imports torch."""

from __future__ import annotations

from typing import Any

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_protocol import EngineProtocol
from splitserve.kvtransfer.host_address import resolve_host
from splitserve.kvtransfer.protocols import KVDataPlane, KVReceiveProtocol, KVSenderProtocol, KVTransportProtocol


class TorchDataPlane:
    """LLMEngine's: KVTransport, KVSender, PostedReceive."""

    def open_transport(self, replica_id: str, engine: EngineProtocol, host: str, timeout_s: float):
        from splitserve.kvtransfer.transport import KVTransport  # torch

        return KVTransport(replica_id, engine.device, host=host, timeout_s=timeout_s)

    def make_sender(self, transport: Any, engine: EngineProtocol) -> KVSenderProtocol:
        from splitserve.kvtransfer.kv_sender import KVSender  # torch

        return KVSender(transport, engine.kv_cache)

    def post_receive(
        self,
        transport: Any,
        engine: EngineProtocol,
        peer_id: str,
        transfer_id: int,
        block_ids: list[int],
        layerwise: bool,
    ) -> KVReceiveProtocol:
        from splitserve.kvtransfer.kv_receiver import PostedReceive  # torch

        return PostedReceive(transport, engine.kv_cache, peer_id, transfer_id, block_ids, layerwise)


class SimulatedDataPlane:
    """SimulatedEngine's: SimulatedTransport, SimulatedKVSender, SimulatedReceive."""

    def open_transport(self, replica_id: str, engine: EngineProtocol, host: str, timeout_s: float):
        from splitserve.kvtransfer.simulated_transport import SimulatedTransport

        return SimulatedTransport(replica_id, host)

    def make_sender(self, transport: Any, engine: EngineProtocol) -> KVSenderProtocol:
        from splitserve.kvtransfer.simulated_kv_sender import SimulatedKVSender

        return SimulatedKVSender(engine.kv_cache)

    def post_receive(
        self,
        transport: Any,
        engine: EngineProtocol,
        peer_id: str,
        transfer_id: int,
        block_ids: list[int],
        layerwise: bool,
    ) -> KVReceiveProtocol:
        from splitserve.kvtransfer.simulated_receive import SimulatedReceive

        return SimulatedReceive(engine.kv_cache, block_ids)


_PLANES: dict[str, type] = {"real": TorchDataPlane, "simulated": SimulatedDataPlane}


def data_plane_for(config: EngineConfig) -> KVDataPlane:
    """The data plane of the engine config declares (EngineConfig.engine)."""
    return _PLANES[config.engine]()


def open_replica_transport(
    plane: KVDataPlane, transport_host: str, replica_id: str, engine: EngineProtocol, timeout_s: float
) -> tuple[str, KVTransportProtocol]:
    """A worker replica's transport: its host resolved (`auto`: this node's address), then the
    plane's transport opened there."""
    host = resolve_host(transport_host)
    return host, plane.open_transport(replica_id, engine, host, timeout_s)
