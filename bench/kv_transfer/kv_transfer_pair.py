"""Two-process KV transfer harness: the real KVSender -> PostedReceive path between two spawned
processes, each holding a real KVCache of a preset's shape, interleaved with a raw gloo
send/recv of the same byte count between the same two processes.

Every trial is timed on one clock (Linux perf_counter is CLOCK_MONOTONIC, shared by all
processes): from the moment the sender starts (KVSender.send_all, or group.send for raw) to the
moment the receiver has every byte in place (PostedReceive.complete returned, i.e. scattered
into the paged cache; or the raw recv's wait returned). Receives are posted before the sender
is told to go, exactly as DecodeWorker does. Block ids on both sides are "contiguous" (one
ascending run each, as a fresh block pool hands them out: both ends move the data in place),
"reversed" (one descending run each, as a pool hands out blocks that requests freed: BlockPool
queues a freed prompt's blocks tail first) or "scattered" (random); the last two are packed and
unpacked through staging buffers.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

SENDER_ID, RECEIVER_ID = "bench-prefill", "bench-decode"
_TIMEOUT_S = 60.0


class HarnessError(RuntimeError):
    """The harness processes failed, timed out or moved wrong data."""


LAYOUTS = ("contiguous", "reversed", "scattered")


@dataclass(frozen=True)
class Trial:
    kind: str  # "kv" (KVSender -> PostedReceive) or "raw" (gloo send/recv)
    num_tokens: int
    layerwise: bool  # kv only: one message set per layer instead of one for all layers
    layout: str  # kv only: one of LAYOUTS (see the module doc)
    timed: bool  # False: warm-up


def build_schedule(lengths: list[int], num_reps: int) -> list[Trial]:
    """One warm-up of each configuration, then num_reps rounds with every configuration
    interleaved, so a change in machine load hits the KV path and the raw baseline alike."""
    configs = [("raw", n, False, "-") for n in lengths]
    configs += [("kv", n, layerwise, layout) for n in lengths for layerwise in (False, True) for layout in LAYOUTS]
    schedule = [Trial(*config, timed=False) for config in configs]
    for rep in range(num_reps):
        order = configs if rep % 2 == 0 else list(reversed(configs))
        schedule += [Trial(*config, timed=True) for config in order]
    return schedule


def _block_ids(trial_index: int, trial: Trial, num_blocks: int, pool_blocks: int) -> tuple[list[int], list[int]]:
    """(sender ids, receiver ids) of a trial, the same in both processes."""
    rng = random.Random(trial_index)
    if trial.layout in ("contiguous", "reversed"):
        starts = [rng.randrange(pool_blocks - num_blocks + 1) for _ in range(2)]
        runs = [list(range(start, start + num_blocks)) for start in starts]
        return runs if trial.layout == "contiguous" else [run[::-1] for run in runs]
    return rng.sample(range(pool_blocks), num_blocks), rng.sample(range(pool_blocks), num_blocks)


def _make_cache(model_dir: str, pool_blocks: int, block_size: int, fill_seed: int | None):
    import torch

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.ops.kv_cache import KVCache

    cache = KVCache(
        ModelConfig.from_pretrained(model_dir),
        EngineConfig(model=model_dir, block_size=block_size, num_kv_blocks=pool_blocks),
    )
    if fill_seed is not None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(fill_seed)))
    cache.kv.add_(0)  # touch every page now, not inside a timed trial
    return cache


def _raw_group(rank: int, store_port: int):
    import torch.distributed as dist

    # The same group setup as kvtransfer.raw_bandwidth (and kvtransfer.pair on CPU).
    timeout = timedelta(seconds=_TIMEOUT_S)
    store = dist.PrefixStore("raw", dist.TCPStore("127.0.0.1", store_port, None, False, timeout))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _endpoint(role: str, results, *args) -> None:
    """Process entry: run one side; a failure is reported instead of leaving the parent waiting."""
    try:
        (_sender if role == "sender" else _receiver)(results, *args)
    except BaseException:
        results.put({"error": f"{role}: {traceback.format_exc()}"})


def _sender(
    results, conn, model_dir: str, pool_blocks: int, block_size: int, store_port: int, schedule: list[Trial]
) -> None:
    import torch

    from splitserve.kvtransfer.kv_sender import KVSender, SendJob
    from splitserve.kvtransfer.transport import KVTransport

    torch.set_num_threads(1)
    cache = _make_cache(model_dir, pool_blocks, block_size, fill_seed=1)
    group = _raw_group(0, store_port)
    transport = KVTransport(SENDER_ID, "cpu", timeout_s=_TIMEOUT_S / 3)
    conn.send(transport.address)
    transport.open_pair(RECEIVER_ID, None, "sender", epoch=0)
    sender = KVSender(transport, cache)
    payloads = {}
    for index, trial in enumerate(schedule):
        num_blocks = -(-trial.num_tokens // block_size)
        num_bytes = num_blocks * cache.bytes_per_block
        src_ids, _ = _block_ids(index, trial, num_blocks, pool_blocks)
        if trial.kind == "raw":
            payload = payloads.setdefault(num_bytes, torch.ones(num_bytes, dtype=torch.uint8))
        if conn.recv() != ("ready", index):
            raise HarnessError(f"receiver out of step at trial {index}")
        started = time.perf_counter()
        if trial.kind == "raw":
            group.send([payload], 1, index).wait(timedelta(seconds=_TIMEOUT_S))
        else:
            job = SendJob(f"trial-{index}", RECEIVER_ID, index + 1, src_ids, trial.layerwise)
            sender.send_all(job)
            job.done.result(timeout=_TIMEOUT_S)
        conn.send((started, time.perf_counter()))
    sender.close()
    transport.close()
    group.shutdown()


def _receiver(
    results, conn, model_dir: str, pool_blocks: int, block_size: int, store_port: int, schedule: list[Trial]
) -> None:
    import torch

    from splitserve.kvtransfer.kv_receiver import PostedReceive
    from splitserve.kvtransfer.transport import KVTransport

    torch.set_num_threads(1)
    cache = _make_cache(model_dir, pool_blocks, block_size, fill_seed=None)
    expected = _make_cache(model_dir, pool_blocks, block_size, fill_seed=1).kv  # the sender's data
    group = _raw_group(1, store_port)
    transport = KVTransport(RECEIVER_ID, "cpu", timeout_s=_TIMEOUT_S / 3)
    transport.open_pair(SENDER_ID, conn.recv(), "receiver", epoch=0)
    buffers = {}
    records = []
    for index, trial in enumerate(schedule):
        num_blocks = -(-trial.num_tokens // block_size)
        num_bytes = num_blocks * cache.bytes_per_block
        src_ids, dst_ids = _block_ids(index, trial, num_blocks, pool_blocks)
        if trial.kind == "raw":
            buffer = buffers.setdefault(num_bytes, torch.empty(num_bytes, dtype=torch.uint8))
            work = group.recv([buffer], 0, index)
        else:
            cache.kv.zero_()
            posted = PostedReceive(transport, cache, SENDER_ID, index + 1, dst_ids, trial.layerwise)
        conn.send(("ready", index))
        if trial.kind == "raw":
            work.wait(timedelta(seconds=_TIMEOUT_S))
            received, posted_seconds = num_bytes, None
        else:
            received, posted_seconds = posted.complete(_TIMEOUT_S)
        done = time.perf_counter()
        started, sender_done = conn.recv()
        if received != num_bytes:
            raise HarnessError(f"trial {index}: {received} bytes received, expected {num_bytes}")
        if trial.kind == "kv" and not torch.equal(cache.kv[:, :, dst_ids], expected[:, :, src_ids]):
            raise HarnessError(f"trial {index}: received KV blocks differ from the sent ones")
        if trial.kind == "raw" and not bool(buffer.eq(1).all()):
            raise HarnessError(f"trial {index}: raw payload corrupted")
        if trial.kind == "raw":
            buffer.fill_(0)
        records.append(
            {
                "kind": trial.kind,
                "num_tokens": trial.num_tokens,
                "layerwise": trial.layerwise,
                "layout": trial.layout,
                "timed": trial.timed,
                "num_bytes": num_bytes,
                "seconds": done - started,
                "sender_seconds": sender_done - started,
                "posted_seconds": posted_seconds,
            }
        )
    results.put(records)
    transport.close()
    group.shutdown()


def run_pair_harness(
    model_dir: str, lengths: list[int], num_reps: int, block_size: int = 16, timeout_s: float = 240.0
) -> list[dict]:
    """Run the schedule for one checkpoint's KV shape; returns one record per trial."""
    import torch.distributed as dist

    max_blocks = -(-max(lengths) // block_size)
    pool_blocks = 4 * max_blocks  # room for scattered, non-contiguous block ids
    schedule = build_schedule(lengths, num_reps)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=_TIMEOUT_S), wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    sender_end, receiver_end = context.Pipe()
    processes = [
        context.Process(
            target=_endpoint,
            args=(role, results, end, model_dir, pool_blocks, block_size, server.port, schedule),
            daemon=True,
        )
        for role, end in (("sender", sender_end), ("receiver", receiver_end))
    ]
    for process in processes:
        process.start()
    try:
        records = results.get(timeout=timeout_s)
    except queue.Empty:
        codes = [p.exitcode for p in processes]
        raise HarnessError(f"harness gave no result in {timeout_s:.0f} s (exit codes {codes})") from None
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    if isinstance(records, dict):
        raise HarnessError(records["error"])
    return records
