"""A mixed hostile workload against a live 1P+1D server, and what it costs: worker RSS at
start and end (is anything growing without bound?), the requests' statuses, and what the
crash-isolated grammar check costs next to an in-process compile (cold and cached).

  python -m splitserve.bench.serving.hostile_input --duration-s 180

The mix (bench/serving/hostile_workload.py): ordinary completions, JSON schemas no earlier request
used (grammar cache churn), the hostile constraints of issue #28 (10,000-deep GBNF chain and
JSON, `a{1000000}`, `{"$ref": "#"}`, tools referring to themselves, empty languages),
streams cancelled mid-way, half-sent requests (closed by the server's request timeout) and
garbage bodies; over gRPC (unless --no-grpc) ordinary and hostile-constraint Generate calls,
cancelled streams, and calls whose request message never comes. Results print as JSON;
bench/results/hostile_input.md is the write-up.

  python -m splitserve.bench.serving.hostile_input --duration-s 1800 --sample-every-s 5 --plot rss.png --bound-mib 32
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time

from splitserve.bench import require_extra, source_commit
from splitserve.bench.loadgen.managed_server import ManagedServer, find_free_port
from splitserve.bench.serving.hostile_workload import Workload
from splitserve.bench.serving.json_schemas import SCHEMAS

psutil = require_extra("psutil")

ROLES = {
    "decode": r"ray::DecodeWorker",
    "prefill": r"ray::PrefillWorker",
    "ingress": r"ray::ServeReplica:[^ ]*:(?!splitserve-controller)",
    "grammar workers": r"splitserve\.engine\.sample\.grammar_worker",
}
DEFAULT_SERVER = (
    "{python} -m splitserve.cluster.cli.main serve --model {model} --http-port {port} --grpc-port {grpc_port} "
    "--prefill-replicas 1 --decode-replicas 1 --num-cpus 4 --http-request-timeout-s {request_timeout} "
    "--grpc.request-timeout-s {request_timeout}"
)


def rss_by_role(root_pid: int) -> dict[str, float]:
    """MiB of resident memory per role, summed over the server's descendant processes."""
    out = dict.fromkeys(ROLES, 0.0)
    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            cmdline = " ".join(process.cmdline())
            rss = process.memory_info().rss / 2**20
        except psutil.Error:
            continue
        for role, pattern in ROLES.items():
            if re.search(pattern, cmdline):
                out[role] += rss
                break
    return {role: round(mib, 1) for role, mib in out.items()}


def _specs(count: int, salt: str):
    from splitserve.proto.messages.grammar_spec import GrammarSpec

    base = list(SCHEMAS.values())
    return [GrammarSpec.json_schema({**base[i % len(base)], "title": f"{salt}-{i}"}) for i in range(count)]


def isolation_cost(model_dir: str, cold: int = 20, cached: int = 2000) -> dict[str, float]:
    """Milliseconds: an in-process compile (what a replica does) next to the ingress's check
    (bounds + a compile in an isolated worker process; a cached verdict)."""
    from splitserve.engine.io.tokenizer import Tokenizer
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.structured_output.grammar_compiler import GrammarCompiler
    from splitserve.engine.structured_output.grammar_config import GrammarConfig
    from splitserve.engine.structured_output.grammar_limits import check_limits
    from splitserve.engine.structured_output.isolated_grammar_checker import IsolatedGrammarChecker

    tokenizer, config = Tokenizer.from_pretrained(model_dir), ModelConfig.from_pretrained(model_dir)
    facts = (tokenizer.to_json(), config.vocab_size, tokenizer.eos_token_ids or config.eos_token_ids)
    compiler = GrammarCompiler(*facts)
    _ = compiler.tokenizer
    checker = IsolatedGrammarChecker(*facts, GrammarConfig())
    checker.warm()

    def timed(fn, specs) -> list[float]:
        times = []
        for spec in specs:
            start = time.perf_counter()
            fn(spec)
            times.append(1e3 * (time.perf_counter() - start))
        return times

    try:
        in_cold = timed(compiler.compile, _specs(cold, "in"))
        iso_cold = timed(checker.check, _specs(cold, "iso"))
        hot = _specs(1, "hot")[0]
        compiler.compile(hot)
        checker.check(hot)
        in_hot = timed(compiler.compile, [hot] * cached)
        iso_hot = timed(checker.check, [hot] * cached)
        bounds = timed(lambda s: check_limits(s, GrammarConfig()), [hot] * cached)
    finally:
        checker.close()
    return {
        "in_process_cold_ms_median": statistics.median(in_cold),
        "isolated_cold_ms_median": statistics.median(iso_cold),
        "in_process_cached_ms_median": statistics.median(in_hot),
        "isolated_cached_ms_median": statistics.median(iso_hot),
        "bounds_check_ms_median": statistics.median(bounds),
    }


def run_workload(
    base_url: str,
    model: str,
    duration_s: float,
    threads: int,
    sample_every_s: float,
    pid: int,
    grpc_target: str | None = None,
) -> dict:
    workloads = [Workload(base_url, model, seed=i, grpc_target=grpc_target) for i in range(threads)]
    warm_up = ["normal", "distinct_schema", "hostile_constraint", "tool_ref_cycle", "cancelled_stream"]
    if grpc_target is not None:
        warm_up += ["grpc_normal", "grpc_hostile", "grpc_cancelled_stream"]
    for case in warm_up:
        getattr(workloads[0], case)()  # warm-up: every path once before the first sample
    samples = [(0.0, rss_by_role(pid))]
    errors: list[str] = []
    stop_at = time.monotonic() + duration_s
    started = time.monotonic()

    def loop(workload: Workload) -> None:
        while time.monotonic() < stop_at:
            try:
                workload.one()
            except Exception as exc:  # a case that fails outright is a finding, not a crash
                errors.append(repr(exc)[:200])

    workers = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workloads]
    for worker in workers:
        worker.start()
    while time.monotonic() < stop_at:
        time.sleep(min(sample_every_s, max(stop_at - time.monotonic(), 0.0)))
        samples.append((round(time.monotonic() - started, 1), rss_by_role(pid)))
    for worker in workers:
        worker.join(300)
    samples.append((round(time.monotonic() - started, 1), rss_by_role(pid)))
    counts: dict[str, dict[int, int]] = {}
    for workload in workloads:
        for name, by_status in workload.counts.items():
            for status, num in by_status.items():
                counts.setdefault(name, {})[status] = counts.setdefault(name, {}).get(status, 0) + num
        workload.close()
    return {"rss_samples": samples, "counts": counts, "errors": errors[:20], "num_errors": len(errors)}


def rss_summary(samples: list, warmup_s: float) -> dict[str, dict[str, float]]:
    """Per role, MiB: at the first sample, at the end of warm-up (the first sample at or past
    warmup_s), the most after it, and at the end; growth_after_warmup is the most minus the
    warm-up value (what a stated bound is checked against)."""
    warm = next((rss for t, rss in samples if t >= warmup_s), samples[-1][1])
    out = {}
    for role in samples[0][1]:
        after = [rss[role] for t, rss in samples if t >= warmup_s] or [warm[role]]
        out[role] = {
            "start": samples[0][1][role],
            "after_warmup": warm[role],
            "max_after_warmup": max(after),
            "end": samples[-1][1][role],
            "growth_after_warmup": round(max(after) - warm[role], 1),
        }
    return out


def plot_rss(samples: list, path: str, warmup_s: float, bound_mib: float | None = None) -> None:
    """One line per role: RSS growth since the first sample (MiB), the warm-up shaded, the
    stated bound (growth after warm-up) dashed above each role's warm-up value."""
    from splitserve.bench.loadgen.plots import plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    minutes = [t / 60 for t, _ in samples]
    summary = rss_summary(samples, warmup_s)
    for role in samples[0][1]:
        first = samples[0][1][role]
        (line,) = axis.plot(minutes, [rss[role] - first for _, rss in samples], label=f"{role} ({first:.0f} MiB at 0)")
        if bound_mib is not None:
            limit = summary[role]["after_warmup"] - first + bound_mib
            axis.hlines(limit, warmup_s / 60, minutes[-1], colors=line.get_color(), linestyles="dashed", linewidth=0.8)
    axis.axvspan(0, warmup_s / 60, color="0.92", label="warm-up")
    axis.set_xlabel("minutes into the mixed hostile workload")
    axis.set_ylabel("RSS growth since the first sample (MiB)")
    title = "Worker RSS, mixed hostile workload (1P+1D, CPU)"
    axis.set_title(title + (f"\ndashed: the bound, warm-up value + {bound_mib:g} MiB" if bound_mib is not None else ""))
    axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the `small` preset, random weights)")
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--sample-every-s", type=float, default=20.0)
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=5.0,
        help="the server's http_request_timeout_s and grpc.request_timeout_s",
    )
    parser.add_argument(
        "--server-args", default="", help="more `splitserve serve` flags, e.g. '--grammar.cache-size 32'"
    )
    parser.add_argument("--no-grpc", action="store_true", help="HTTP cases only (no gRPC calls in the mix)")
    parser.add_argument("--warmup-s", type=float, default=300.0, help="RSS growth is measured from here on")
    parser.add_argument("--plot", help="draw the RSS curve to this PNG")
    parser.add_argument("--bound-mib", type=float, help="the stated bound on growth after warm-up (drawn dashed)")
    parser.add_argument(
        "--from-results", help="a results JSON this bench printed: summarize (and --plot) it, run nothing"
    )
    args = parser.parse_args(argv)
    if args.from_results:
        with open(args.from_results) as f:
            samples = json.load(f)["rss_samples"]
        print(json.dumps(rss_summary(samples, args.warmup_s), indent=1))
        if args.plot:
            plot_rss(samples, args.plot, args.warmup_s, args.bound_mib)
        return 0
    model = args.model
    if model is None:
        from splitserve.engine.builtin_models.make_model import write_random_checkpoint

        model = str(write_random_checkpoint(tempfile.mkdtemp(prefix="hostile-model-"), preset="small"))
    result = {"commit": source_commit(), "isolation_cost": isolation_cost(model)}
    grpc_port = find_free_port()
    command = DEFAULT_SERVER.format(
        python=sys.executable,
        model=model,
        port="{port}",
        grpc_port=grpc_port,
        request_timeout=args.request_timeout_s,
    )
    if args.server_args:
        command += " " + args.server_args
    with ManagedServer(command, startup_timeout_s=600) as server:
        served = server.base_url
        import httpx

        model_id = httpx.get(f"{served}/v1/models", timeout=10).json()["data"][0]["id"]
        result["server_pid_before"] = server.pid
        grpc_target = None if args.no_grpc else f"127.0.0.1:{grpc_port}"
        result.update(
            run_workload(served, model_id, args.duration_s, args.threads, args.sample_every_s, server.pid, grpc_target)
        )
        result["health_after"] = httpx.get(f"{served}/health", timeout=10).json()
    result["command"] = " ".join(["python -m splitserve.bench.serving.hostile_input", *(argv or sys.argv[1:])])
    result["rss_summary"] = rss_summary(result["rss_samples"], args.warmup_s)
    if args.plot:
        plot_rss(result["rss_samples"], args.plot, args.warmup_s, args.bound_mib)
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
