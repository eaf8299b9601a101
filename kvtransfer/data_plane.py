"""The KV data plane a worker's engine gets, chosen by its KV cache: for LLMEngine the real one
(KVTransport, whose pairs move tensors over torch.distributed; KVSender; PostedReceive), for
SimulatedEngine the timed simulated one (SimulatedTransport, SimulatedKVSender, SimulatedReceive).
Each is imported only when chosen, so a simulated replica never imports torch."""

from __future__ import annotations

from typing import Any

from splitserve.engine.engine_protocol import EngineProtocol
from splitserve.engine.simulated.simulated_kv_cache import SimulatedKVCache
from splitserve.kvtransfer.host_address import resolve_host


def open_transport(replica_id: str, engine: EngineProtocol, host: str, timeout_s: float):
    if isinstance(engine.kv_cache, SimulatedKVCache):
        from splitserve.kvtransfer.simulated_transport import SimulatedTransport

        return SimulatedTransport(replica_id, host)
    from splitserve.kvtransfer.transport import KVTransport  # torch

    return KVTransport(replica_id, engine.device, host=host, timeout_s=timeout_s)


def open_replica_transport(
    transport_host: str, replica_id: str, engine: EngineProtocol, timeout_s: float
) -> tuple[str, Any]:
    """A worker replica's transport (EngineWorker's `open_transport`): its host resolved
    (`auto`: this node's address), then the engine's kind of transport opened there."""
    host = resolve_host(transport_host)
    return host, open_transport(replica_id, engine, host, timeout_s)


def make_sender(transport, kv_cache):
    """The prefill side: KVSender or SimulatedKVSender (same SendJob protocol)."""
    if isinstance(kv_cache, SimulatedKVCache):
        from splitserve.kvtransfer.simulated_kv_sender import SimulatedKVSender

        return SimulatedKVSender(kv_cache)
    from splitserve.kvtransfer.kv_sender import KVSender  # torch

    return KVSender(transport, kv_cache)


def post_receive(transport, kv_cache, peer_id: str, transfer_id: int, block_ids: list[int], layerwise: bool):
    """The decode side: PostedReceive or SimulatedReceive (complete, abandon)."""
    if isinstance(kv_cache, SimulatedKVCache):
        from splitserve.kvtransfer.simulated_receive import SimulatedReceive

        return SimulatedReceive(kv_cache, block_ids)
    from splitserve.kvtransfer.kv_receiver import PostedReceive  # torch

    return PostedReceive(transport, kv_cache, peer_id, transfer_id, block_ids, layerwise)
