"""Structured-output overhead through a real server: output tok/s with and without a JSON
schema at each concurrency, plus grammar compile time (cold, and once cached).

For each concurrency C it sends N chat requests (the five schemas of
bench/serving/json_schemas.py in turn, seeded sampling) with response_format json_schema
and records each request's completion tokens; then the same prompts and seeds without a
schema, each with max_tokens = its constrained twin's token count and ignore_eos, so both
runs generate exactly the same number of tokens and differ only by the grammar. Repeats
alternate which run goes first. tok/s = completion tokens / wall time of the run.

  python -m splitserve.bench.serving.structured_output --model DIR_OF_BENCH_CHECKPOINT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from splitserve.bench import RESULTS_DIR, source_commit
from splitserve.bench.loadgen.managed_server import ManagedServer, find_free_port
from splitserve.bench.serving.json_schemas import MAX_INSTANCE_TOKENS, SCHEMAS

DEFAULT_OUT = RESULTS_DIR / "structured_output.md"
NAMES = list(SCHEMAS)
DEFAULT_SERVER = (
    "{python} -m splitserve.cluster.cli.main serve --model {model} --http-port {port} --grpc-port {grpc_port} "
    "--prefill-replicas 1 --decode-replicas 1 --router kv --num-cpus 6 --max-num-seqs 64"
)


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe {NAMES[i % 5]} number {i} as JSON."}]


async def run(client, model: str, n: int, concurrency: int, token_counts: list[int] | None) -> tuple[float, list[int]]:
    """One run of n requests, `concurrency` in flight: constrained when token_counts is None,
    else unconstrained with those lengths. Returns (wall seconds, completion tokens each)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with sem:
            if token_counts is None:
                schema = SCHEMAS[NAMES[i % 5]]
                fmt = {"type": "json_schema", "json_schema": {"name": NAMES[i % 5], "schema": schema, "strict": True}}
                res = await client.chat.completions.create(
                    model=model, messages=messages(i), max_tokens=MAX_INSTANCE_TOKENS, seed=i, response_format=fmt
                )
                if res.choices[0].finish_reason != "stop":
                    raise RuntimeError(f"a constrained request did not complete: {res.choices[0]}")
                json.loads(res.choices[0].message.content)
            else:
                res = await client.chat.completions.create(
                    model=model,
                    messages=messages(i),
                    max_tokens=token_counts[i],
                    seed=i,
                    extra_body={"ignore_eos": True},
                )
            return res.usage.completion_tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - start, list(counts)


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for name in ("splitserve_grammar_mask_seconds_total", "splitserve_grammar_mask_steps_total"):
        values = re.findall(rf'^{name}\{{pool="decode"\}} (\S+)$', text, re.MULTILINE)
        out[name] = float(values[0]) if values else 0.0
    return out


def compile_times(model_dir: str, repeats: int = 300) -> dict[str, float]:
    from splitserve.engine.io.tokenizer import Tokenizer
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.structured_output.grammar_compiler import GrammarCompiler
    from splitserve.proto.messages.grammar_spec import GrammarSpec

    tokenizer = Tokenizer.from_pretrained(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    compiler = GrammarCompiler(tokenizer.to_json(), config.vocab_size, tokenizer.eos_token_ids)
    _ = compiler.tokenizer  # built once per process, not per schema
    cold, cached = [], []
    for schema in SCHEMAS.values():
        start = time.perf_counter()
        compiler.new_matcher(GrammarSpec.json_schema(schema))
        cold.append(time.perf_counter() - start)
    for _ in range(repeats):
        for schema in SCHEMAS.values():
            start = time.perf_counter()
            # What a repeated request pays: spec from its JSON, cache hit, a fresh matcher.
            compiler.new_matcher(GrammarSpec.json_schema(schema))
            cached.append(time.perf_counter() - start)
    return {
        "cold_ms_mean": 1e3 * statistics.mean(cold),
        "cold_ms_max": 1e3 * max(cold),
        "cached_ms_median": 1e3 * statistics.median(cached),
        "cached_ms_p99": 1e3 * sorted(cached)[int(0.99 * len(cached))],
    }


async def bench_level(base_url: str, model: str, concurrency: int, n: int, repeats: int) -> dict:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600, max_retries=0) as client:
        await run(client, model, min(n, 4), min(concurrency, 4), None)  # warm-up: compiles, caches
        wall_c, counts = await run(client, model, n, concurrency, None)
        results = {"constrained": [sum(counts) / wall_c], "plain": []}
        before = scrape(base_url)
        for rep in range(repeats):
            if rep % 2 == 0:
                wall, got = await run(client, model, n, concurrency, counts)
                results["plain"].append(sum(got) / wall)
                if rep:
                    wall, got = await run(client, model, n, concurrency, None)
                    results["constrained"].append(sum(got) / wall)
            else:
                wall, got = await run(client, model, n, concurrency, None)
                results["constrained"].append(sum(got) / wall)
                wall, got = await run(client, model, n, concurrency, counts)
                results["plain"].append(sum(got) / wall)
        after = scrape(base_url)
    steps = after["splitserve_grammar_mask_steps_total"] - before["splitserve_grammar_mask_steps_total"]
    mask_s = after["splitserve_grammar_mask_seconds_total"] - before["splitserve_grammar_mask_seconds_total"]
    return {
        "concurrency": concurrency,
        "requests": n,
        "tokens": sum(counts),
        "constrained_tok_s": statistics.median(results["constrained"]),
        "plain_tok_s": statistics.median(results["plain"]),
        "runs": results,
        "decode_mask_ms_per_step": 1e3 * mask_s / steps if steps else 0.0,
    }


def render(levels: list[dict], compile_ms: dict, command: str, commit: str) -> str:
    lines = [
        "# Structured output overhead (JSON schema vs none)",
        "",
        f"Command: `{command}`  ",
        f"{commit}; {os.cpu_count()} CPUs shared with other jobs (load average at start "
        f"{os.getloadavg()[0]:.1f}); server: `splitserve serve`, 1 prefill + 1 decode replica, the `bench` model.",
        "",
        "Both runs of a level generate identical token counts (the plain run uses each constrained",
        "request's length with ignore_eos), so the difference is the grammar's cost. Median over the",
        "repeats; target: overhead <= 10% at concurrency 32.",
        "",
        "| concurrency | requests | tokens | plain tok/s | JSON-schema tok/s | overhead | decode mask ms/step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        overhead = 1 - lv["constrained_tok_s"] / lv["plain_tok_s"]
        lines.append(
            f"| {lv['concurrency']} | {lv['requests']} | {lv['tokens']} | {lv['plain_tok_s']:.0f} | "
            f"{lv['constrained_tok_s']:.0f} | {100 * overhead:.1f}% | {lv['decode_mask_ms_per_step']:.3f} |"
        )
    lines += ["", "Per run (tok/s):", ""]
    for lv in levels:
        runs = lv["runs"]
        lines.append(
            f"- concurrency {lv['concurrency']}: plain {', '.join(f'{v:.0f}' for v in runs['plain'])}; "
            f"JSON schema {', '.join(f'{v:.0f}' for v in runs['constrained'])}"
        )
    lines += [
        "",
        "Grammar compile time (llguidance, this model's tokenizer, the five schemas; target: <= 5 ms once cached):",
        "",
        f"- cold: mean {compile_ms['cold_ms_mean']:.2f} ms, max {compile_ms['cold_ms_max']:.2f} ms",
        f"- cached (spec parse + cache hit + fresh matcher): median {compile_ms['cached_ms_median']:.3f} ms, "
        f"p99 {compile_ms['cached_ms_p99']:.3f} ms",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests", type=int, default=0, help="per run (default: max(16, 3 x concurrency))")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--server", default=DEFAULT_SERVER, help="command template ({port}, {grpc_port}, {model}, {python})"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    compile_ms = compile_times(args.model)
    print(compile_ms, flush=True)
    command = (
        args.server.replace("{python}", sys.executable)
        .replace("{model}", args.model)
        .replace("{grpc_port}", str(find_free_port()))
    )
    levels = []
    log_path = Path(tempfile.gettempdir()) / f"structured_output_bench.{os.getpid()}.server.log"
    with ManagedServer(command, log_path=log_path) as server:
        model = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        for c in (int(x) for x in args.concurrency.split(",")):
            n = args.requests or max(16, 3 * c)
            level = asyncio.run(bench_level(server.base_url, model, c, n, args.repeats))
            print(level, flush=True)
            levels.append(level)
    text = render(
        levels,
        compile_ms,
        "python -m splitserve.bench.serving.structured_output " + " ".join(sys.argv[1:]),
        source_commit(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
