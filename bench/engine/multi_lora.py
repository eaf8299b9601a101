"""Multi-LoRA serving cost on one engine: the same request mix for the base alone and for 1, 8
and 64 adapters (64 above max_loras=8, so the host cache and loads from disk are exercised).

One LLMEngine per case (the SHAPE model of lora_load_cost.py, rank-16 peft-format adapters on
every target module), all requests queued at once and stepped to completion; a request's TTFT
is from the start to the step that gave its first token. Reported per case: output tokens/s and
its ratio to the base alone, TTFT p50/p99, adapter loads per 1,000 requests (by tier), and the
LoRA share of the step time, (time - base time) / time (the base alone takes the scripted CPU
decode step, which LoRA steps do not: the share counts that too). Then, in the same run,
adapter-aware routing against the plain KV router on two real engines (lora_routing.py).

  .venv/bin/python -m splitserve.bench.engine.multi_lora --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from splitserve.bench import source_commit
from splitserve.bench.engine import lora_routing
from splitserve.bench.engine.lora_load_cost import RANK, write_adapter, write_base
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams

MAX_LORAS, MAX_CPU_LORAS = 8, 16
CASES = (0, 1, 8, 64)  # adapters in the mix; 0: the base alone, LoRA off


def engine_for(base: Path, adapters: dict[str, str]) -> LLMEngine:
    lora = (
        dict(
            enable_lora=True,
            lora_modules=adapters,
            max_loras=MAX_LORAS,
            max_cpu_loras=MAX_CPU_LORAS,
            max_lora_rank=RANK,
        )
        if adapters
        else {}
    )
    return LLMEngine(EngineConfig(model=str(base), num_kv_blocks=1024, max_num_seqs=64, **lora))


def run_case(engine: LLMEngine, names: list[str], num_requests: int, prompt_len: int, max_tokens: int) -> dict:
    loads_before = dict(engine.stats().lora_loads)  # the start-up reads are not the mix's
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i in range(num_requests):
        prompt = [(11 * i + 7 * j) % 500 + 5 for j in range(prompt_len)]  # no prefix shared
        adapter = names[i % len(names)] if names else None
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora_adapter=adapter)
        engine.add_request(prompt_token_ids=prompt, params=params, request_id=f"r{i}")
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    ttfts = sorted(first.values())
    stats = engine.stats()
    return {
        "adapters": len(names),
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "loads_per_1000": {
            tier: 1000 * (n - loads_before.get(tier, 0)) / num_requests for tier, n in stats.lora_loads.items()
        },
        "load_seconds": dict(stats.lora_load_seconds),
    }


def measure(work: Path, num_requests: int, prompt_len: int, max_tokens: int, repeats: int) -> tuple[list, dict]:
    """The cases' results, and the routing section's (lora_routing.measure)."""
    base = work / "base"
    write_base(base)
    probe = engine_for(base, {})
    paths = {}
    for i in range(max(CASES)):
        paths[f"a{i}"] = str(work / f"a{i}")
        write_adapter(probe, Path(paths[f"a{i}"]))
    del probe
    # The cases take turns, one run each per round, so that a burst of load from another
    # process on a shared machine lands on every case's runs alike, not on one case's.
    runs: dict[int, list[dict]] = {count: [] for count in CASES}
    for _ in range(repeats + 1):  # each case's first run warms up (and is dropped)
        for count in CASES:
            names = [f"a{i}" for i in range(count)]
            engine = engine_for(base, {n: paths[n] for n in names})
            runs[count].append(run_case(engine, names, num_requests, prompt_len, max_tokens))
    results = [min(runs[count][1:], key=lambda r: r["seconds"]) for count in CASES]  # the least disturbed run
    base_run = results[0]
    for r in results:
        r["vs_base"] = r["tokens_per_s"] / base_run["tokens_per_s"]
        r["lora_share"] = max(r["seconds"] - base_run["seconds"], 0.0) / r["seconds"]
    return results, lora_routing.measure(base, paths)


def write_report(out: Path, results: list[dict], routing: dict, args: argparse.Namespace, commit: str) -> None:
    rows = [
        "| adapters | tok/s | vs base | TTFT p50 / p99 ms | loads per 1,000 requests | LoRA share of step time |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        loads = ", ".join(f"{tier} {n:.0f}" for tier, n in sorted(r["loads_per_1000"].items())) or "-"
        name = "base alone (LoRA off)" if not r["adapters"] else str(r["adapters"])
        rows.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['vs_base']:.2f}x | {r['ttft_p50_ms']:.0f} / "
            f"{r['ttft_p99_ms']:.0f} | {loads} | {100 * r['lora_share']:.0f}% |"
        )
    eight = next(r for r in results if r["adapters"] == 8)
    met = "met" if eight["vs_base"] >= 0.8 else "not met"
    text = f"""# Multi-LoRA on one engine

Command: `python -m splitserve.bench.engine.multi_lora --out bench/results` ({commit}).

{args.num_requests} requests queued at once, each a distinct {args.prompt_len}-token prompt and
{args.max_tokens} output tokens (greedy, ignore_eos), adapters assigned round-robin; an 8-layer
512-wide Llama, rank-16 adapters on all 7 target modules, `max_loras` {MAX_LORAS},
`max_cpu_loras` {MAX_CPU_LORAS}; CPU, torch threads 1; best of {args.repeats} runs after a
warm-up, the cases taking turns run by run. TTFT counts from the moment all requests were
queued (a batch, not an arrival process).

{chr(10).join(rows)}

Target (issue 39): throughput at 8 resident adapters >= 0.8x the base alone: **{met}** ({eight["vs_base"]:.2f}x).

![throughput against the base alone, and TTFT, per case](multi_lora.png)

{lora_routing.section(routing)}
Raw: `{json.dumps(results)}`

Raw (routing): `{json.dumps(routing)}`
"""
    (out / "multi_lora.md").write_text(text)
    plot(out / "multi_lora.png", results)


def plot(path: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["base" if not r["adapters"] else f"{r['adapters']} adapters" for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [r["vs_base"] for r in results], color="tab:blue")
    left.axhline(0.8, color="tab:red", linestyle="--", label="target at 8 adapters (0.8x)")
    left.set_ylabel("output tokens/s vs the base alone")
    left.legend()
    right.bar(labels, [r["ttft_p50_ms"] for r in results], color="tab:green", label="p50")
    right.plot(labels, [r["ttft_p99_ms"] for r in results], "ko", label="p99")
    right.set_ylabel("TTFT, ms (all requests queued at once)")
    right.legend()
    fig.suptitle("Multi-LoRA on one engine (CPU, 8-layer 512-wide Llama, rank 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    commit = source_commit()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        results, routing = measure(Path(work), args.num_requests, args.prompt_len, args.max_tokens, args.repeats)
    write_report(Path(args.out), results, routing, args, commit)
    print((Path(args.out) / "multi_lora.md").read_text())


if __name__ == "__main__":
    main()
