"""Disaggregated prefill -> decode in one process, without Ray: two real engines of any
tensor-parallel sizes (their follower ranks spawned processes running the KV data plane's rank
side, RankKVPlane), each with the real data plane (TorchDataPlane), and the handoff the workers
run (prefill/prefill_worker.py, decode/prefill_client.py) -- decode reserves (prefix hits
included), posts its receives, prefill computes the prompt sending each layer's KV as it is done
(or all after the step), decode completes the receives and admits the request, then decodes it
to the end. What comes back: the tokens, the log-probabilities, the bytes each side counted and
the times. tests/kvtransfer/test_tp_handoff.py checks parity with it; tp_transfer.py times it."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kvtransfer.data_plane import TorchDataPlane
from splitserve.kvtransfer.protocols import ReceiveOrder
from splitserve.kvtransfer.send_job import SendJob
from splitserve.proto.messages.handoff import PrefillResult
from splitserve.proto.messages.sampling_params import SamplingParams

TIMEOUT_S = 60.0
_request_ids = itertools.count(1)
_transfer_ids = itertools.count(1)


class Replica:
    """An engine of tensor_parallel_size `tp` with its data plane, named replica_id."""

    def __init__(self, replica_id: str, model: str, tp: int, **engine_config):
        self.replica_id = replica_id
        self.plane = TorchDataPlane()
        config = EngineConfig(model=model, tensor_parallel_size=tp, **engine_config)
        self.engine = LLMEngine(config, None, self.plane.follower_extension())
        self.transport = self.plane.open_transport(replica_id, self.engine, "127.0.0.1", TIMEOUT_S)
        self.sender = self.plane.make_sender(self.transport, self.engine)

    def close(self) -> None:
        self.sender.close()
        self.transport.close()
        self.engine.close()


@dataclass
class Handoff:
    token_ids: list[int]
    logprobs: list[float]
    bytes_received: int  # what decode's ranks received
    bytes_sent: int  # what prefill's ranks sent
    blocks_sent: int
    cached_blocks: int  # the prompt's blocks decode had cached
    prefill_s: float  # the prefill engine's steps, until the first token
    exposed_s: float  # prefill done -> every decode rank holds its heads of every block
    sender_s: float  # the slowest prefill rank's sender busy time


def pair(prefill: Replica, decode: Replica, epoch: int = 0) -> None:
    """Open the pair both ways, concurrently, as the workers do."""
    sender = threading.Thread(
        target=prefill.transport.open_pair, args=(decode.replica_id, decode.transport.address, "sender", epoch)
    )
    sender.start()
    decode.transport.open_pair(prefill.replica_id, prefill.transport.address, "receiver", epoch)
    sender.join(TIMEOUT_S)


def _run(engine: LLMEngine, request_id: str, layer_hook=None) -> list:
    outputs = []
    while not any(out.request_id == request_id and out.finished for out in outputs):
        outputs += engine.step(layer_hook)
    return [out for out in outputs if out.request_id == request_id]


def handoff(prefill: Replica, decode: Replica, prompt: list[int], max_tokens: int, layerwise: bool) -> Handoff:
    """One request prefilled on `prefill`, its KV moved, decoded on `decode` (greedy)."""
    rid = f"r{next(_request_ids)}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    seq = decode.engine.make_sequence(None, prompt, params, rid)
    reservation = decode.engine.reserve_prompt_blocks(seq)
    assert reservation is not None
    cached = len(seq.block_table) - len(reservation.block_indices)
    transfer_id = next(_transfer_ids)
    order = ReceiveOrder(prefill.replica_id, transfer_id, tuple(reservation.block_ids), layerwise)
    posted = decode.plane.post_receive(decode.transport, decode.engine, order)
    indices = list(reservation.block_indices)
    job = SendJob(rid, decode.replica_id, transfer_id, [], layerwise, num_blocks=len(indices))
    pseq = prefill.engine.make_sequence(None, prompt, params, rid, prefill_only=True)
    prefill.engine.add_sequence(pseq)

    def layer_hook(batch):
        if rid not in batch.request_ids_computing_last_token():
            return None
        job.block_ids = prefill.engine.prompt_block_ids(rid, indices)
        return prefill.sender.layer_callback([job]) if layerwise else None

    started = time.perf_counter()
    (first,) = _run(prefill.engine, rid, layer_hook)
    prefilled = time.perf_counter()
    if not layerwise:
        prefill.sender.send_all(job)
    job.done.result(TIMEOUT_S)
    received, _ = posted.complete(TIMEOUT_S)
    landed = time.perf_counter()
    prefill.engine.release_prefilled(rid)
    result = PrefillResult(
        request_id=rid,
        first_token=first.new_token_ids[0],
        first_logprob=first.new_logprobs[0],
        num_cached_tokens=0,
        num_blocks_sent=len(job.block_ids),
        num_bytes_sent=job.num_bytes,
        prefill_seconds=0.0,
        transfer_seconds=job.seconds,
    )
    admitted = decode.engine.admit_prefilled(rid, result)
    rest = [] if admitted.finished else _run(decode.engine, rid)
    token_ids = list(admitted.new_token_ids) + [t for out in rest for t in out.new_token_ids]
    logprobs = list(admitted.new_logprobs) + [p for out in rest for p in out.new_logprobs]
    return Handoff(
        token_ids,
        logprobs,
        received,
        job.num_bytes,
        len(job.block_ids),
        cached,
        prefilled - started,
        landed - prefilled,
        job.seconds,
    )
