"""Interactive latency with and without a Batch API job, priority classes on vs FIFO.

One in-process deployment per policy (1 prefill + 1 decode replica, local Ray, CPU), the
real HTTP app on uvicorn. Per policy: a closed-loop run measures capacity (requests/s and
tokens/s); interactive Poisson load at --load x that capacity runs alone, then again with a
batch job of --batch-lines lines submitted through the `openai` client's Batch API. Reports
interactive TTFT / ITL p99 in both phases, and the batch tokens/s during the second as a
share of the spare token throughput (capacity - interactive).

    python -m splitserve.bench.serving.batch_priority --out bench/results/batch_priority.json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import tempfile
import time

import httpx

from splitserve.bench.loadgen.client import sse_lines


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


async def one_request(client: httpx.AsyncClient, model: str, i: int, max_tokens: int, stats: dict) -> None:
    body = {
        "model": model,
        "prompt": f"question {i}: tell me",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    last, first = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            stats["errors"] += 1
            return
        async for line in sse_lines(r):
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                stats["ttft"].append(now - start)
            elif last is not None:
                stats["itl"].append(now - last)
            last = now
    stats["tokens"] += max_tokens
    stats["done"] += 1


def new_stats() -> dict:
    return {"ttft": [], "itl": [], "tokens": 0, "done": 0, "errors": 0}


async def closed_loop(base: str, model: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    stats = new_stats()
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:

        async def worker(w: int) -> None:
            i = 0
            while time.perf_counter() < deadline:
                await one_request(client, model, w * 100_000 + i, max_tokens, stats)
                i += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        stats["seconds"] = time.perf_counter() - start
    return stats


async def poisson(base: str, model: str, rate: float, seconds: float, max_tokens: int, seed: int) -> dict:
    stats = new_stats()
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        tasks, start, i = [], time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            tasks.append(asyncio.create_task(one_request(client, model, i, max_tokens, stats)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        stats["seconds"] = time.perf_counter() - start
    return stats


def summary(stats: dict) -> dict:
    return {
        "requests": stats["done"],
        "errors": stats["errors"],
        "ttft_p99_ms": 1000 * p99(stats["ttft"]),
        "itl_p99_ms": 1000 * p99(stats["itl"]),
        "tokens_per_s": stats["tokens"] / stats["seconds"],
    }


def batch_tokens(backend) -> float:
    value = backend.metrics.registry.get_sample_value(
        "splitserve_batch_generation_tokens_total", {"model_name": backend.model_name}
    )
    return value or 0.0


async def run_policy(model_dir: str, policy: str, args) -> dict:
    import openai
    import uvicorn

    from splitserve.cluster.batch.batch_service import BatchService
    from splitserve.cluster.config import ServeConfig
    from splitserve.cluster.frontend.backend import ServingBackend
    from splitserve.cluster.frontend.http.api import build_http_app

    pool = {"num_kv_blocks": 256, "resources": {"num_cpus": 1}, "torch_threads": 1}
    cfg = ServeConfig.model_validate(
        {
            "model": model_dir,
            "prefill": {"replicas": 1, **pool},
            "decode": {"replicas": 1, **pool},
            "priority": {"policy": policy},
            "state_dir": tempfile.mkdtemp(prefix="bench-state-"),
            "batch": {"max_concurrency": args.batch_concurrency, "poll_interval_s": 0.1},
        }
    )
    backend = ServingBackend(cfg, model_dir)
    await backend.start()
    service = BatchService(cfg, f"bench-{policy}", backend.metrics.registry, backend.model_name)
    server = uvicorn.Server(
        uvicorn.Config(
            build_http_app(backend, batch=service), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
        )
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        service.start()
        base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        model = backend.model_name
        await closed_loop(base, model, 2, 3, args.max_tokens)  # warm-up
        capacity = summary(await closed_loop(base, model, args.capacity_concurrency, args.seconds, args.max_tokens))
        rate = args.load * capacity["requests"] / args.seconds
        alone = summary(await poisson(base, model, rate, args.seconds, args.max_tokens, seed=1))
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        lines = "".join(
            json.dumps(
                {
                    "custom_id": f"b{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "model": model,
                        "prompt": f"Summarize record {i}:",
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
            )
            + "\n"
            for i in range(args.batch_lines)
        )
        upload = io.BytesIO(lines.encode())
        upload.name = "batch.jsonl"
        f = await client.files.create(file=upload, purpose="batch")
        job = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        await asyncio.sleep(2)  # the runner ramps up
        before, t0 = batch_tokens(backend), time.perf_counter()
        mixed = summary(await poisson(base, model, rate, args.seconds, args.max_tokens, seed=1))
        batch_tps = (batch_tokens(backend) - before) / (time.perf_counter() - t0)
        done = (await client.batches.retrieve(job.id)).request_counts
        await client.batches.cancel(job.id)
        await client.close()
        spare = max(capacity["tokens_per_s"] - mixed["tokens_per_s"], 1e-9)
        return {
            "policy": policy,
            "capacity": capacity,
            "interactive_rate_rps": rate,
            "alone": alone,
            "with_batch": mixed,
            "batch_tokens_per_s": batch_tps,
            "batch_share_of_spare": batch_tps / spare,
            "batch_lines_done_by_end": done.completed,
        }
    finally:
        await service.stop()
        server.should_exit = True
        await serving
        await backend.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--load", type=float, default=0.6, help="interactive load as a fraction of capacity")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--capacity-concurrency", type=int, default=8)
    parser.add_argument("--batch-lines", type=int, default=2000)
    parser.add_argument("--batch-concurrency", type=int, default=16)
    parser.add_argument("--policies", default="priority,fcfs")
    args = parser.parse_args(argv)

    import ray

    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    model_dir = str(write_random_checkpoint(tempfile.mkdtemp(prefix="bench-model-"), preset="tiny"))
    ray.init(
        num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False
    )
    results = []
    try:
        for policy in args.policies.split(","):
            results.append(asyncio.run(run_policy(model_dir, policy, args)))
            print(json.dumps(results[-1], indent=1), flush=True)
    finally:
        ray.shutdown()
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
