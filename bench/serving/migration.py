"""Streams across decode-replica kills: mid-stream migration under load (issue 38).

Per configuration (the host KV tier off, then on: the same requests, arrivals and kill
times), one in-process deployment: 1 prefill + 4 decode replicas on local Ray (CPU, the tiny
make-model checkpoint), the real HTTP app on uvicorn, its controller in-process replacing
what dies. A closed loop first measures the decode pool's output tokens/s (in the first
configuration; both then run the same Poisson load at --load x that). The open loop runs
--baseline-s undisturbed, then --failure-s during which the busiest decode replica (of those
up for the controller's healthy_after_s, so that restarts are not backed off) is ray.kill'ed
every --kill-every-s. Then: every stream finishes, the pool is back at its size and every
replica idle with its KV pool at baseline, and the moved streams (and as many unmoved ones)
are sent again alone: their greedy text must equal what the client got under the kills.

    flock /work/locks/ray.lock .venv/bin/python -m splitserve.bench.serving.migration --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import httpx

from splitserve.bench.loadgen.arrivals import poisson_arrival_offsets
from splitserve.bench.loadgen.client import sse_lines
from splitserve.bench.serving.migration_faults import (
    DISPATCHER_LOG,
    MovedLabels,
    MoveTap,
    kill_loop,
    pools_at_baseline,
    sample_pool,
)
from splitserve.bench.serving.migration_report import Stream, markdown, plot, summarize


async def stream_one(http: httpx.AsyncClient, model: str, stream: Stream, max_tokens: int, t0: float) -> None:
    """One greedy completion, streamed; token counts per chunk from its log-probabilities."""
    body = {
        "model": model,
        "prompt": stream.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream.sent_s = time.perf_counter() - t0
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers={"x-request-id": stream.label}) as r:
            stream.status = r.status_code
            if r.status_code != 200:
                stream.error = f"http_{r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in sse_lines(r):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter() - t0
                if "error" in chunk:
                    stream.error = f"stream_error: {json.dumps(chunk['error'])[:200]}"
                    break
                if chunk.get("usage"):
                    stream.usage_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    num_tokens = len((choice.get("logprobs") or {}).get("token_logprobs") or [])
                    if num_tokens:
                        stream.chunks.append((now, num_tokens))
                    stream.text += choice.get("text") or ""
                    stream.finish = choice.get("finish_reason") or stream.finish
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.end_s = time.perf_counter() - t0


def make_streams(num: int, prompt_len: int, seed: int, prefix: str) -> list[Stream]:
    """Distinct random prompts inside the tiny model's vocabulary (no shared prefixes)."""
    rng = random.Random(seed)
    return [Stream(f"{prefix}{i}", [rng.randrange(20, 500) for _ in range(prompt_len)]) for i in range(num)]


async def closed_loop(http, model: str, args, seconds: float, concurrency: int, t0: float) -> list[Stream]:
    streams: list[Stream] = []
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            (stream,) = make_streams(1, args.prompt_len, hash((w, i, seconds)), f"cap{w}.{i}.")
            streams.append(stream)
            await stream_one(http, model, stream, args.max_tokens, t0)
            i += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return streams


def serve_config(model_dir: str, host_tier_gib: float, args):
    from splitserve.cluster.config import ServeConfig

    pool = {"resources": {"num_cpus": 1}, "torch_threads": 1}
    return ServeConfig.model_validate(
        {
            "model": model_dir,
            "prefill": {"replicas": 1, "num_kv_blocks": args.prefill_blocks, **pool},
            "decode": {"replicas": args.decode_replicas, "num_kv_blocks": args.decode_blocks, **pool},
            "kv_offloading_size": host_tier_gib,
        }
    )


async def run_config(model_dir: str, name: str, host_tier_gib: float, args, rate: float | None) -> dict:
    """One deployment: capacity (unless rate is given), the open loop with its kills, the checks."""
    import uvicorn

    from splitserve.cluster.frontend.backend import ServingBackend
    from splitserve.cluster.frontend.http.api import build_http_app

    cfg = serve_config(model_dir, host_tier_gib, args)
    backend = ServingBackend(cfg, model_dir)
    started = time.perf_counter()
    await backend.start()
    start_s = time.perf_counter() - started
    tap = MoveTap(backend.metrics.migrations)
    backend.metrics.migrations = tap
    moved = MovedLabels()
    logging.getLogger(DISPATCHER_LOG).addHandler(moved)
    app = build_http_app(backend)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    cluster = backend.cluster
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        # Idle connections expire well before uvicorn's 5 s keep-alive closes them: a request
        # sent on one the server is closing fails with ReadError, which is no migration's doing.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=1.0)
        async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout_s, limits=limits) as http:
            model, t0 = backend.model_name, time.perf_counter()
            await closed_loop(http, model, args, args.warmup_s, 4, t0)
            capacity = None
            if rate is None:
                t_cap = time.perf_counter()
                cap_streams = await closed_loop(http, model, args, args.capacity_s, args.capacity_concurrency, t0)
                window = (t_cap - t0 + 2.0, t_cap - t0 + args.capacity_s)  # past the ramp-up
                tokens = sum(n for s in cap_streams for at, n in s.chunks if window[0] <= at < window[1])
                capacity = tokens / (window[1] - window[0])
                rate = args.load * capacity / args.max_tokens
            duration = args.baseline_s + args.failure_s
            offsets = [
                o for o in poisson_arrival_offsets(int(rate * duration * 2) + 10, rate, args.seed) if o < duration
            ]
            streams = make_streams(len(offsets), args.prompt_len, args.seed, "s")
            kill_at = [args.baseline_s + args.first_kill_s + k * args.kill_every_s for k in range(args.num_kills)]
            kill_at = [at for at in kill_at if at < duration]
            kills: list[dict] = []
            pool_samples: list = []
            stop = asyncio.Event()
            t0 = time.perf_counter()
            sampler = asyncio.create_task(sample_pool(cluster, t0, pool_samples, stop))
            killer = asyncio.create_task(kill_loop(cluster, kill_at, cfg.controller.healthy_after_s, t0, kills))
            tasks = []
            for stream, offset in zip(streams, offsets):
                await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
                tasks.append(asyncio.create_task(stream_one(http, model, stream, args.max_tokens, t0)))
            await killer
            await asyncio.wait(tasks, timeout=args.request_timeout_s + 30)
            baseline = await pools_at_baseline(cluster, args.decode_replicas, args.baseline_timeout_s)
            stop.set()
            await sampler
            verify = await rerun_alone(http, model, streams, moved.labels, args)
        return {
            "name": name,
            "host_tier_gib": host_tier_gib,
            "start_s": start_s,
            "capacity_tokens_per_s": capacity,
            "rate_rps": rate,
            "kills": kills,
            "pool_samples": pool_samples,
            "baseline": baseline,
            "verify": verify,
            "moves": tap.moves,
            "refusals": tap.refusals,
            "gap_s": tap.gap_s,
            "recomputed_tokens": tap.recomputed_tokens,
            "moved_labels": sorted(moved.labels),
            "move_log": [(label, at - t0) for label, at in moved.moves],
            "retries": cluster.dispatcher.num_retries,  # requests moved before their first token
            "streams": [s.to_dict() for s in streams],
        }
    finally:
        logging.getLogger(DISPATCHER_LOG).removeHandler(moved)
        server.should_exit = True
        await serving
        await backend.shutdown()


async def rerun_alone(http, model: str, streams: list[Stream], moved: set[str], args) -> dict:
    """The moved streams and as many unmoved ones (the control), each sent again with the
    cluster otherwise idle: greedy text must equal the text the client got the first time."""
    done = [s for s in streams if s.completed(args.max_tokens)]
    picked = {
        "moved": [s for s in done if s.label in moved][: args.verify],
        "unmoved": [s for s in done if s.label not in moved and s.sent_s >= args.baseline_s][: args.verify],
    }
    limit = asyncio.Semaphore(8)

    async def again(s: Stream) -> bool:
        async with limit:
            copy = Stream(s.label + ".again", s.prompt)
            await stream_one(http, model, copy, args.max_tokens, time.perf_counter())
            return copy.text == s.text and copy.completed(args.max_tokens)

    out = {}
    for kind, chosen in picked.items():
        same = await asyncio.gather(*(again(s) for s in chosen))
        out[kind] = {"checked": len(chosen), "equal": sum(same)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for migration.json and migration.png")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny run (seconds, 2 decode replicas): checks the script"
    )
    parser.add_argument("--decode-replicas", type=int, default=4)
    parser.add_argument("--load", type=float, default=0.8, help="open-loop load as a share of measured capacity")
    parser.add_argument("--capacity-concurrency", type=int, default=32)
    parser.add_argument("--capacity-s", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--baseline-s", type=float, default=45.0, help="open loop without failures")
    parser.add_argument("--failure-s", type=float, default=120.0, help="open loop with kills")
    parser.add_argument("--first-kill-s", type=float, default=5.0, help="into the failure phase")
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--num-kills", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefill-blocks", type=int, default=96, help="prefill's device KV: a few prompts")
    parser.add_argument("--decode-blocks", type=int, default=640)
    parser.add_argument("--host-tier-gib", type=float, default=0.01, help="kv_offloading_size of the tier run")
    parser.add_argument("--verify", type=int, default=32, help="moved (and unmoved) streams sent again")
    parser.add_argument("--request-timeout-s", type=float, default=180.0)
    parser.add_argument("--baseline-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.decode_replicas, args.capacity_s, args.warmup_s, args.baseline_s = 2, 4.0, 1.0, 4.0
        args.failure_s, args.first_kill_s, args.num_kills, args.max_tokens, args.verify = 8.0, 2.0, 1, 32, 4

    import ray

    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(write_random_checkpoint(tempfile.mkdtemp(prefix="bench-model-"), preset="tiny"))
    ray.init(
        num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False
    )
    results, rate = [], None
    try:
        for name, gib in (("no host tier", 0.0), ("host tier", args.host_tier_gib)):
            results.append(asyncio.run(run_config(model_dir, name, gib, args, rate)))
            rate = results[0]["rate_rps"]
            print(json.dumps(summarize(results[-1], args), indent=1), flush=True)
    finally:
        ray.shutdown()
    summaries = [summarize(r, args) for r in results]
    (out / "migration.json").write_text(json.dumps({"args": vars(args), "summaries": summaries, "runs": results}))
    plot(results, args, out / "migration.png")
    print(markdown(summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
