"""The KV data plane a worker's engine gets (protocols.py's KVDataPlane), chosen once by the
kind of engine its EngineConfig declares: `real` -> TorchDataPlane (pairs over
torch.distributed, over every rank of a tensor-parallel replica), `simulated` ->
SimulatedDataPlane (timed waits). Each plane imports its implementations only when used, so a
simulated replica never imports torch."""

from __future__ import annotations

from typing import Any

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_protocol import EngineProtocol
from splitserve.kvtransfer.host_address import resolve_host
from splitserve.kvtransfer.protocols import (
    KVDataPlane,
    KVReceiveProtocol,
    KVSenderProtocol,
    KVTransportProtocol,
    ReceiveOrder,
)


class TorchDataPlane:
    """LLMEngine's, at any TP size on either side: TensorParallelTransport,
    TensorParallelKVSender, TensorParallelReceive over its ranks' KVTransport, KVSender and
    PostedReceive (a follower rank's run in its RankKVPlane). The engine is an LLMEngine."""

    def follower_extension(self):
        from splitserve.kvtransfer.rank_kv_plane import RankKVPlane  # torch

        return RankKVPlane

    def open_transport(self, replica_id: str, engine: Any, host: str, timeout_s: float):
        from splitserve.kvtransfer.follower_link import FollowerLink  # torch
        from splitserve.kvtransfer.head_map import KVLayout
        from splitserve.kvtransfer.tp_transport import TensorParallelTransport

        layout = KVLayout(engine.model_config.num_key_value_heads, engine.config.tensor_parallel_size)
        followers = None if engine.tensor_parallel is None else FollowerLink(engine.tensor_parallel)
        return TensorParallelTransport(replica_id, engine.device, host, timeout_s, layout, followers)

    def make_sender(self, transport: Any, engine: EngineProtocol) -> KVSenderProtocol:
        from splitserve.kvtransfer.tp_sender import TensorParallelKVSender  # torch

        return TensorParallelKVSender(transport, engine.kv_cache)

    def post_receive(self, transport: Any, engine: EngineProtocol, order: ReceiveOrder) -> KVReceiveProtocol:
        from splitserve.kvtransfer.tp_receive import TensorParallelReceive  # torch

        return TensorParallelReceive(transport, engine.kv_cache, order)


class SimulatedDataPlane:
    """SimulatedEngine's: SimulatedTransport, SimulatedKVSender, SimulatedReceive."""

    def follower_extension(self):
        return None  # the simulated engine has no tensor-parallel ranks

    def open_transport(self, replica_id: str, engine: EngineProtocol, host: str, timeout_s: float):
        from splitserve.kvtransfer.simulated_transport import SimulatedTransport

        return SimulatedTransport(replica_id, host)

    def make_sender(self, transport: Any, engine: EngineProtocol) -> KVSenderProtocol:
        from splitserve.kvtransfer.simulated_kv_sender import SimulatedKVSender

        return SimulatedKVSender(engine.kv_cache)

    def post_receive(self, transport: Any, engine: EngineProtocol, order: ReceiveOrder) -> KVReceiveProtocol:
        from splitserve.kvtransfer.simulated_receive import SimulatedReceive

        return SimulatedReceive(engine.kv_cache, list(order.block_ids))


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
