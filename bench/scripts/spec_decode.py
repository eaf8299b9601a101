"""Runs the speculative-decoding benchmark of bench/results/spec_decode.md: for each configuration, start
`splitserve serve` (colocated: 0 prefill + 1 decode replica, 1 torch thread) on a free port,
run `splitserve bench --url` against it, snapshot its /metrics (the splitserve_spec_decode_*
series: acceptance and the chosen-k counts), stop it. Every run gets the same requests (same
--seed).

The box is shared (2 cores, other jobs come and go) and one run lasts only seconds, so one run
per configuration compares the load of two moments, not two configurations: the first version
of this driver measured `none` 1.5x slower than an n-gram server that barely speculated, in
both orders. So each configuration runs REPEATS times, interleaved (ABC, CBA, ABC, ...), the
table gives the median and every run, and each run also records what contention does not
inflate much: the decode replica's own CPU seconds per output token (psutil, the replica's
process), next to the box's busy cores and the load average while it ran.

  .venv/bin/python bench/scripts/spec_decode.py quote_c1 | mixed_c32 | quote_c1_vllm [REPEATS [CONFIG,...]]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench import require_extra
from splitserve.bench.loadgen.managed_server import ManagedServer

psutil = require_extra("psutil")

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
M = "/root/.cache/splitserve/models/720e346365b9eb53/bench-llama-trained1000"
D = "/root/.cache/splitserve/models/c5627c59af78d28e/draft-llama-trained1000"
SERVE = f"{BIN}/splitserve serve {M} --prefill-replicas 0 --decode-replicas 1 --decode-num-cpus 1 --http-port {{port}} --grpc-port 0"
VLLM = (
    f"VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH={HERE}/vllm_shim"
    f" /work/venvs/vllm/bin/python -m vllm.entrypoints.openai.api_server --model {M}"
    " --host 127.0.0.1 --port {port} --dtype float32 --max-model-len 4096"
)
VLLM_NGRAM = (
    """ --speculative-config '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,"""
    """ "prompt_lookup_max": 4}'"""
)
QUOTE = ["--workload", "quote", "--tokenizer", M, "--num-requests", "8", "--max-tokens", "128", "--concurrency", "1"]
RUNS = {
    "quote_c1": (
        QUOTE,
        {
            "none": SERVE,
            "ngram": SERVE + " --speculative.method ngram",
            "ngram-fixed4": SERVE
            + " --speculative.method ngram --speculative.policy fixed --speculative.num-speculative-tokens 4",
            "draft": SERVE + f" --speculative.method draft --speculative.draft-model {D}",
            # The mechanism at its best: every draft token accepted (the policy would turn it off:
            # a draft as costly as the target cannot pay, so it is fixed here).
            "draft=target": SERVE
            + f" --speculative.method draft --speculative.draft-model {M} --speculative.policy fixed",
        },
    ),
    "mixed_c32": (
        [
            "--workload",
            "mixed",
            "--num-requests",
            "96",
            "--short-len",
            "128",
            "--long-fraction",
            "0",
            "--length-jitter",
            "0",
            "--max-tokens",
            "64",
            "--vocab-range",
            "10:2000",
            "--concurrency",
            "32",
        ],
        {"none": SERVE, "ngram": SERVE + " --speculative.method ngram"},
    ),
    "quote_c1_vllm": (QUOTE, {"vllm-none": VLLM, "vllm-ngram": VLLM + VLLM_NGRAM}),
}


def spec_series(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("splitserve_spec_decode"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def engine_processes(pgid: int) -> list:
    """The server's decode replica processes (Ray actors: their own process groups, under the
    server's raylet, so found by ancestry)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if (proc.info["cmdline"] or [""])[0].startswith("ray::DecodeWorker") and any(
                os.getpgid(a.pid) == pgid for a in proc.parents()
            ):
                found.append(proc)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def cpu_seconds(procs: list) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def run_one(command: str, args: list[str], out_dir: Path, tag: str) -> dict:
    with ManagedServer(command, log_path=out_dir / f"{tag}.server.log") as server:
        procs = engine_processes(server.pid)
        cpu0, box0, load0, t0 = cpu_seconds(procs), psutil.cpu_times(), os.getloadavg()[0], time.monotonic()
        bench = [f"{BIN}/splitserve", "bench", "--url", server.base_url, *args, "--ignore-eos", "--seed", "0"]
        bench += ["--no-progress", "--out", str(out_dir / tag)]
        print("$", " ".join(bench), flush=True)
        subprocess.run(bench, check=True, timeout=900, stdout=subprocess.DEVNULL)
        cpu1, box1, load1, wall = cpu_seconds(procs), psutil.cpu_times(), os.getloadavg()[0], time.monotonic() - t0
        metrics = spec_series(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    (out_dir / f"{tag}.spec_metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
    run = json.loads((out_dir / tag / "results.json").read_text())["configs"][0]["runs"][0]["metrics"]
    tokens = run["total_completion_tokens"]
    busy = sum(getattr(box1, f) - getattr(box0, f) for f in ("user", "system", "nice"))
    return {
        "out_tok_s": run["output_tokens_per_s"],
        "tpot_ms_p50": run["tpot_ms"]["p50"],
        "ok": run["num_ok"],
        "replica_cpu_ms_per_token": 1000 * (cpu1 - cpu0) / tokens if procs and tokens else None,
        "box_busy_cores": busy / wall,
        "load_1min": [load0, load1],
        "spec": metrics,
    }


def main(name: str, repeats: int, only: list[str] | None = None) -> None:
    args, configs = RUNS[name]
    configs = {config: command for config, command in configs.items() if not only or config in only}
    out_dir = HERE.parent / "results" / "spec_decode" / name  # untracked: .gitignore keeps run output out
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {config: [] for config in configs}
    for repeat in range(repeats):
        items = list(configs.items()) if repeat % 2 == 0 else list(reversed(configs.items()))
        for config, command in items:
            tag = f"{config.replace('=', '-eq-')}-r{repeat}"
            runs[config].append(run_one(command, args, out_dir, tag))
            print(config, repeat, json.dumps({k: v for k, v in runs[config][-1].items() if k != "spec"}), flush=True)
    base = statistics.median(r["out_tok_s"] for r in runs[next(iter(configs))])
    print("| config | out tok/s median (runs) | vs first | TPOT ms median | replica CPU ms / token (runs) |")
    for config, rs in runs.items():
        tok = statistics.median(r["out_tok_s"] for r in rs)
        cpu = [r["replica_cpu_ms_per_token"] for r in rs]
        each = ", ".join(f"{r['out_tok_s']:.0f}" for r in rs)
        cpus = ", ".join("-" if c is None else f"{c:.2f}" for c in cpu)
        tpot = statistics.median(r["tpot_ms_p50"] for r in rs)
        print(f"| {config} | {tok:.1f} ({each}) | {tok / base:.2f}x | {tpot:.2f} | {cpus} |")
    (out_dir / "summary.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main(
        sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3, sys.argv[3].split(",") if len(sys.argv) > 3 else None
    )
