"""Baseline: raw torch.distributed gloo send/recv bandwidth between two spawned processes.

The KV transfer benchmark compares its throughput with this (same 2-rank gloo group setup as
splitserve.kvtransfer.pair, no packing, no transport bookkeeping).

    python -m splitserve.bench.kv_transfer.raw_bandwidth --sizes-mb 8 64 --iters 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import time
from datetime import timedelta

_WARMUP_ITERS = 2


def _endpoint(
    rank: int, host: str, port: int, num_bytes: int, num_iters: int, timeout_s: float, results: multiprocessing.Queue
) -> None:
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore("raw_bandwidth", dist.TCPStore(host, port, None, False, timeout))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    group = dist.ProcessGroupGloo(store, rank, 2, options)
    payload = torch.ones(num_bytes, dtype=torch.uint8) if rank == 0 else torch.empty(num_bytes, dtype=torch.uint8)
    peer = 1 - rank

    def transfer_once() -> None:
        work = group.send([payload], peer, 0) if rank == 0 else group.recv([payload], peer, 0)
        work.wait(timeout)

    for _ in range(_WARMUP_ITERS):
        transfer_once()
    started = time.perf_counter()
    for _ in range(num_iters):
        transfer_once()
    elapsed = time.perf_counter() - started
    if rank == 1:  # the receiver's clock: it finishes only when the last byte has landed
        results.put({"elapsed_s": elapsed, "checksum_ok": bool(payload.eq(1).all())})
    group.shutdown()


def measure_gloo_bandwidth(
    num_bytes: int, num_iters: int = 10, host: str = "127.0.0.1", timeout_s: float = 60.0
) -> dict:
    """Send num_bytes from rank 0 to rank 1 num_iters times (after warm-up); returns the rate."""
    import torch.distributed as dist

    if num_bytes <= 0 or num_iters <= 0:
        raise ValueError(f"num_bytes and num_iters must be > 0, got {num_bytes}, {num_iters}")
    server = dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_endpoint, args=(rank, host, server.port, num_bytes, num_iters, timeout_s, results))
        for rank in (0, 1)
    ]
    for process in processes:
        process.start()
    try:
        outcome = results.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"gloo bandwidth run of {num_bytes} bytes gave no result in {timeout_s}s") from None
    finally:
        for process in processes:
            process.join(timeout=timeout_s)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    if not outcome["checksum_ok"]:
        raise RuntimeError("the received payload does not match what was sent")
    total_bytes = num_bytes * num_iters
    return {
        "backend": "gloo",
        "host": host,
        "num_bytes": num_bytes,
        "num_iters": num_iters,
        "seconds_per_iter": outcome["elapsed_s"] / num_iters,
        "bytes_per_s": total_bytes / outcome["elapsed_s"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 64])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    for size_mb in args.sizes_mb:
        result = measure_gloo_bandwidth(int(size_mb * (1 << 20)), args.iters, args.host)
        result["gb_per_s"] = result["bytes_per_s"] / 1e9
        print(json.dumps(result))


if __name__ == "__main__":
    main()
