"""KV transfer through the real Ray actors: one PrefillWorker, one DecodeWorker, local Ray.

Each request runs DecodeWorker's own remote-prefill path (reserve blocks -> open the pair ->
post every receive -> PrefillWorker.prefill computes and sends -> wait for the receives and
unpack). The subclasses below only add timestamps; every byte moves through the product code.

Timeline of one request, on one clock (Linux perf_counter is CLOCK_MONOTONIC, shared by the
actor processes of one host):
  prefill_done  = PrefillWorker.prefill entered + PrefillResult.prefill_seconds (first token)
  transfer_done = the decode side's receives completed and unpacked
  exposed       = transfer_done - prefill_done: what disaggregation adds to time-to-first-token
Prompts are fresh random tokens, so neither side has a prefix-cache hit (checked).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import msgspec

from splitserve.cluster.config import PoolResources
from splitserve.cluster.control.worker_pool import WorkerPool
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.decode.decode_worker import DecodeWorker
from splitserve.kvtransfer.wire_layout import ascending_run_start
from splitserve.prefill.prefill_worker import PrefillWorker
from splitserve.proto.messages.handoff import PrefillResult
from splitserve.proto.messages.request_channel import Submit
from splitserve.proto.messages.sampling_params import SamplingParams
from splitserve.runtime.worker_config import WorkerConfig

NUM_KV_BLOCKS = 1024  # ServeConfig's default pool size
LEASE_S = 20.0


class TimedPrefillWorker(PrefillWorker):
    """PrefillWorker whose result also says when prefill() was entered and how its blocks lay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_place: dict[str, bool] = {}

    def _bind_blocks(self, job) -> None:
        super()._bind_blocks(job)
        self._in_place[job.request_id] = ascending_run_start(job.block_ids) is not None

    async def prefill(self, handoff_bytes: bytes) -> bytes:
        entered = time.perf_counter()
        result = PrefillResult.from_bytes(await super().prefill(handoff_bytes))
        result.extra = {"entered_at": entered, "send_in_place": self._in_place.pop(result.request_id, None)}
        return result.to_bytes()


class TimedDecodeWorker(DecodeWorker):
    """DecodeWorker with one extra method: a timed remote prefill of one prompt."""

    async def timed_prefill(self, request_id: str, prompt: list[int], layerwise: bool, prefill_id: str) -> dict:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        submit = Submit(request_id, prompt, params, prefill_id, layerwise=layerwise, lease_s=LEASE_S)
        seq = self.engine.make_sequence(None, prompt, params, request_id)
        started = time.perf_counter()
        result = await self._remote_prefill(seq, submit)
        transfer_done = time.perf_counter()
        dst_blocks = list(seq.block_table)
        await asyncio.wrap_future(self.loop.call(lambda engine: engine.release_reservation(request_id)))
        return {
            "started": started,
            "transfer_done": transfer_done,
            "recv_in_place": ascending_run_start(dst_blocks) is not None,
            "result": msgspec.structs.asdict(result),
        }


def _engine_config(model_dir: str, max_len: int) -> dict:
    return {
        "model": model_dir,
        "block_size": 16,
        "num_kv_blocks": NUM_KV_BLOCKS,
        "max_num_seqs": 8,
        "max_num_batched_tokens": max(2048, max_len),
        "device": "cpu",
    }


def _schedule(lengths: list[int], num_reps: int) -> list[tuple[int, bool, bool]]:
    """(num_tokens, layerwise, timed): a warm-up of each, then rounds alternating the order."""
    configs = [(n, layerwise) for n in lengths for layerwise in (False, True)]
    schedule = [(n, layerwise, False) for n, layerwise in configs]
    for rep in range(num_reps):
        order = configs if rep % 2 == 0 else list(reversed(configs))
        schedule += [(n, layerwise, True) for n, layerwise in order]
    return schedule


def run_actor_path(
    model_dir: str, vocab_size: int, lengths: list[int], num_reps: int, seed: int = 0, timeout_s: float = 120.0
) -> list[dict]:
    """Start 1 prefill + 1 decode actor (1 CPU, 1 torch thread each) on the running local Ray
    instance, run the schedule, stop them. Returns one record per request."""
    import ray

    engine_config = _engine_config(model_dir, max(lengths))
    namespace = f"kvbench-{uuid.uuid4().hex[:6]}"
    pools = [
        WorkerPool(
            name,
            cls,
            WorkerConfig(engine_config, namespace, torch_threads=1, transfer_timeout_s=LEASE_S),
            PoolResources(num_cpus=1),
        )
        for name, cls in ((PREFILL, TimedPrefillWorker), (DECODE, TimedDecodeWorker))
    ]
    rng = random.Random(seed)
    records = []
    try:
        prefill, decode = (pool.start(1)[0] for pool in pools)
        for index, (num_tokens, layerwise, timed) in enumerate(_schedule(lengths, num_reps)):
            # Random ids from a range that skips the special tokens: every block hash is new.
            prompt = [rng.randrange(8, vocab_size) for _ in range(num_tokens)]
            out = ray.get(
                decode.handle.timed_prefill.remote(f"kvbench-{index}", prompt, layerwise, prefill.replica_id),
                timeout=timeout_s,
            )
            result = out["result"]
            num_blocks = -(-num_tokens // 16)
            if result["num_cached_tokens"] or result["num_blocks_sent"] != num_blocks:
                raise RuntimeError(f"request {index} hit a prefix cache: {result}")
            prefill_done = result["extra"]["entered_at"] + result["prefill_seconds"]
            records.append(
                {
                    "num_tokens": num_tokens,
                    "layerwise": layerwise,
                    "timed": timed,
                    "num_bytes": result["num_bytes_sent"],
                    "prefill_seconds": result["prefill_seconds"],
                    "sender_seconds": result["transfer_seconds"],
                    "exposed_seconds": out["transfer_done"] - prefill_done,
                    "ttft_seconds": out["transfer_done"] - out["started"],
                    "send_in_place": result["extra"]["send_in_place"],
                    "recv_in_place": out["recv_in_place"],
                }
            )
    finally:
        for pool in pools:
            pool.stop()
    return records
