"""Router microbenchmark: KV event ingest rate and route() decision latency at scale.

Synthetic data shaped like a prefix tree: `num_roots` shared prefix chains (system prompts,
few-shot headers) of `root_blocks` blocks, popularity skewed so a few roots are everywhere.
Each replica caches requests = a prefix of one root + a private tail, emitting one `stored`
event per request (only the blocks it did not hold yet, like BlockPool). Both pools get their
own data over the same roots, so prompts hit both indexes.

  python -m splitserve.bench.control_plane.router_microbench                       # 1M blocks/pool over 64 replicas
  python -m splitserve.bench.control_plane.router_microbench --num-blocks 100000 --num-decisions 2000
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

from splitserve.bench import source_commit
from splitserve.cluster.routing.index import KVIndex
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.cluster.routing.router_config import RouterConfig

TARGET_INGEST_BLOCKS_PER_S = 200_000
TARGET_P99_MS = 1.0


def build_roots(rng: random.Random, num_roots: int, root_blocks: int) -> list[list[int]]:
    return [[rng.getrandbits(64) for _ in range(root_blocks)] for _ in range(num_roots)]


def build_replica_events(
    rng: random.Random, roots: list[list[int]], num_blocks: int, max_tail_blocks: int
) -> list[list]:
    """Wire-form stored events for one replica until it holds num_blocks distinct hashes."""
    held: set[int] = set()
    events: list[list] = []
    weights = [1.0 / (rank + 1) for rank in range(len(roots))]  # Zipf-like popularity
    while len(held) < num_blocks:
        root = rng.choices(roots, weights)[0]
        prefix = root[: rng.randint(1, len(root))]
        tail = [rng.getrandbits(64) for _ in range(rng.randint(1, max_tail_blocks))]
        new = [h for h in prefix + tail if h not in held][: num_blocks - len(held)]
        held.update(new)
        events.append([len(events) + 1, "stored", new])
    return events


def measure_ingest(index: KVIndex, events_by_replica: dict[str, list[list]]) -> tuple[int, float]:
    """Blocks applied and seconds taken, feeding each replica its events in 32-event batches."""
    num_blocks = sum(len(e[2]) for events in events_by_replica.values() for e in events)
    start = time.perf_counter()
    for rid, events in events_by_replica.items():
        for i in range(0, len(events), 32):
            if not index.apply_events(rid, events[i : i + 32]):
                raise RuntimeError(f"unexpected gap for {rid}")
    return num_blocks, time.perf_counter() - start


def measure_removal(index: KVIndex, rng: random.Random, fraction: float) -> tuple[int, float]:
    """Evict `fraction` of each replica's blocks with one `removed` event per 64 blocks."""
    batches = {}
    for rid in index.replica_ids():
        victims = rng.sample(sorted(index.replica_hashes(rid)), int(index.num_blocks(rid) * fraction))
        seq = index.last_seq(rid)
        batches[rid] = [[seq + 1 + i // 64, "removed", victims[i : i + 64]] for i in range(0, len(victims), 64)]
    return measure_ingest(index, batches)


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def make_prompt(rng: random.Random, roots: list[list[int]], prompt_blocks: int) -> list[int]:
    root = rng.choice(roots)
    shared = root[: rng.randint(0, min(len(root), prompt_blocks))]
    return shared + [rng.getrandbits(64) for _ in range(prompt_blocks - len(shared))]


def measure_routes(
    router: Router, rng: random.Random, roots: list[list[int]], args, replica_ids: dict[str, list[str]]
) -> list[float]:
    prompts = [make_prompt(rng, roots, args.prompt_blocks) for _ in range(args.num_decisions)]
    num_tokens = args.prompt_blocks * args.block_size + args.block_size // 2
    latencies_ms: list[float] = []
    for i, hashes in enumerate(prompts):
        if i % 16 == 0:  # load reports trickle in while routing
            pool = PREFILL if i % 32 == 0 else DECODE
            rid = rng.choice(replica_ids[pool])
            router.update_load(pool, rid, LoadReport(rng.randint(0, 8192), rng.randint(0, 32), rng.random()))
        start = time.perf_counter_ns()
        router.route(block_hashes=hashes, num_prompt_tokens=num_tokens)
        latencies_ms.append((time.perf_counter_ns() - start) / 1e6)
    return latencies_ms


def measure_routes_with_hashing(router: Router, rng: random.Random, args) -> list[float]:
    """route(token_ids): includes hashing the prompt's blocks (blake2b per block)."""
    num_tokens = args.prompt_blocks * args.block_size
    latencies_ms = []
    for _ in range(args.num_hashing_decisions):
        token_ids = [rng.randrange(32000) for _ in range(num_tokens)]
        start = time.perf_counter_ns()
        router.route(token_ids)
        latencies_ms.append((time.perf_counter_ns() - start) / 1e6)
    return latencies_ms


def latency_row(name: str, latencies_ms: list[float]) -> str:
    ordered = sorted(latencies_ms)
    return (
        f"| {name} | {len(ordered)} | {statistics.median(ordered):.3f} | "
        f"{percentile(ordered, 0.99):.3f} | {ordered[-1]:.3f} |"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-replicas", type=int, default=64, help="replicas per pool")
    parser.add_argument("--num-blocks", type=int, default=1_000_000, help="indexed (replica, block) entries per pool")
    parser.add_argument("--num-roots", type=int, default=512, help="shared prefix chains")
    parser.add_argument("--root-blocks", type=int, default=48, help="blocks per shared prefix")
    parser.add_argument("--max-tail-blocks", type=int, default=32, help="private blocks per cached request, at most")
    parser.add_argument("--prompt-blocks", type=int, default=64, help="blocks per routed prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-decisions", type=int, default=10_000)
    parser.add_argument(
        "--num-hashing-decisions", type=int, default=1_000, help="route(token_ids) calls, which include block hashing"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in (
        "num_replicas",
        "num_blocks",
        "num_roots",
        "root_blocks",
        "max_tail_blocks",
        "prompt_blocks",
        "block_size",
        "num_decisions",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_hashing_decisions < 0:
        parser.error("--num-hashing-decisions must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    roots = build_roots(rng, args.num_roots, args.root_blocks)
    per_replica = args.num_blocks // args.num_replicas
    router = Router(RouterConfig(policy="kv", local_prefill_threshold=32), block_size=args.block_size, seed=args.seed)
    replica_ids = {pool: [f"{pool}-{i}" for i in range(args.num_replicas)] for pool in (PREFILL, DECODE)}
    ingest = []
    for pool in (PREFILL, DECODE):
        for rid in replica_ids[pool]:
            router.add_replica(pool, rid)
        events = {rid: build_replica_events(rng, roots, per_replica, args.max_tail_blocks) for rid in replica_ids[pool]}
        num_events = sum(len(e) for e in events.values())
        num_blocks, seconds = measure_ingest(router.index(pool), events)
        ingest.append((f"{pool} stored", num_events, num_blocks, seconds))
        del events
    num_removed, seconds = measure_removal(router.index(DECODE), rng, 0.1)
    ingest.append(("decode removed (10%)", -1, num_removed, seconds))
    gc.collect()

    prefill_index = router.index(PREFILL)
    routes = measure_routes(router, rng, roots, args, replica_ids)
    match_ms = []
    for _ in range(args.num_decisions):
        hashes = make_prompt(rng, roots, args.prompt_blocks)
        start = time.perf_counter_ns()
        prefill_index.prefix_match(hashes)
        match_ms.append((time.perf_counter_ns() - start) / 1e6)
    hashing = measure_routes_with_hashing(router, rng, args) if args.num_hashing_decisions else []

    lines = [
        source_commit(),
        "",
        f"Index: {args.num_replicas} replicas/pool, {prefill_index.num_indexed_hashes:,} distinct"
        f" hashes / {args.num_blocks:,} entries in the prefill pool; prompts of "
        f"{args.prompt_blocks} blocks x {args.block_size} tokens; Python "
        f"{sys.version.split()[0]}.",
        "",
        "| ingest | events | blocks | seconds | blocks/s |",
        "|---|---|---|---|---|",
    ]
    for name, num_events, num_blocks, secs in ingest:
        events_cell = str(num_events) if num_events >= 0 else "-"
        lines.append(f"| {name} | {events_cell} | {num_blocks:,} | {secs:.3f} | {num_blocks / secs:,.0f} |")
    lines += [
        "",
        "| latency (ms) | calls | p50 | p99 | max |",
        "|---|---|---|---|---|",
        latency_row("route(block_hashes), both pools", routes),
        latency_row("prefix_match, prefill index", match_ms),
    ]
    if hashing:
        lines.append(latency_row("route(token_ids) incl. hashing", hashing))
    min_ingest = min(n / s for _, _, n, s in ingest)
    p99 = percentile(sorted(routes), 0.99)
    lines += [
        "",
        f"Targets: ingest >= {TARGET_INGEST_BLOCKS_PER_S:,} blocks/s: "
        f"{'met' if min_ingest >= TARGET_INGEST_BLOCKS_PER_S else 'MISSED'}; "
        f"route p99 <= {TARGET_P99_MS} ms: {'met' if p99 <= TARGET_P99_MS else 'MISSED'}.",
    ]
    decisions = router.decision_counts()
    lines.append("Decisions by reason: " + ", ".join(f"{k}={v}" for k, v in sorted(decisions.items())))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
