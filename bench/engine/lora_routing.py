"""Adapter-aware routing against the plain KV router, on real engines, no Ray: multi_lora.py's
routing section.

Two LoRA replicas, each a real LLMEngine (max_loras 4, max_cpu_loras 8) serving 8 adapters
(both replicas' slots together hold them all only if each keeps its own half, as in
tests/cluster/routing/test_adapter_routing.py), and one Router. Requests for the 8 adapters, in
a seeded random order, arrive 8 per round; each is routed, then added to the engine it was
routed to; then every engine runs one step and reports to the router what a replica reports (its KV events, and its EngineStats with the
adapters in its device slots and host cache, through PollReply and LoadReport.from_poll), as
the router's poll loop applies them. The same request sequence for each router:
- adapter-aware: the kv policy with its measured adapter costs (cluster/routing/adapter_affinity.py);
- plain KV: the kv policy with both adapter costs 0: precise prefix routing that ignores where
  adapters are resident (prefix hits still count only for the same adapter, as engines hash them);
- round-robin.
Reported per router: adapter loads per 1,000 requests by tier (the engines' own counts, start-up
reads excluded), the router's adapter-hit share, the requests per replica, and output tokens per
second of engine step time (the engines step one after the other on this CPU: the compute a
token cost, summed over the replicas)."""

from __future__ import annotations

import random
import time
from pathlib import Path

from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.cluster.routing.router import Router
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from splitserve.proto.messages.sampling_params import SamplingParams

REPLICAS, ADAPTERS, SLOTS, CPU_SLOTS = 2, 8, 4, 8
REQUESTS, PER_ROUND, PROMPT, OUTPUT = 128, 8, 64, 16
NO_PREFILL_POOL = 10**9  # every request prefills on its decode replica (no prefill pool here)
ROUTERS = {
    "adapter-aware (kv)": RouterConfig(policy="kv", local_prefill_threshold=NO_PREFILL_POOL),
    "plain KV (adapter costs 0)": RouterConfig(
        policy="kv", local_prefill_threshold=NO_PREFILL_POOL, adapter_load_tokens=0, adapter_host_load_tokens=0
    ),
    "round-robin": RouterConfig(policy="round-robin", local_prefill_threshold=NO_PREFILL_POOL),
}


def replica(base: Path, paths: dict[str, str]) -> LLMEngine:
    config = EngineConfig(
        model=str(base),
        num_kv_blocks=512,
        max_num_seqs=32,
        enable_lora=True,
        lora_modules=paths,
        max_loras=SLOTS,
        max_cpu_loras=CPU_SLOTS,
        max_lora_rank=16,
    )
    return LLMEngine(config)


def report(router: Router, rid: str, engine: LLMEngine) -> None:
    """What the router's poll of the replica applies: its KV events, then its load."""
    stats = engine.stats()
    poll = PollReply(engine.take_events(), stats, num_pinned=0, num_active=stats.num_running, transfer=TransferTotals())
    router.apply_events(DECODE, rid, poll.events)
    router.update_load(DECODE, rid, LoadReport.from_poll(poll))


def run_router(base: Path, paths: dict[str, str], config: RouterConfig) -> dict:
    engines = {f"d{i}": replica(base, paths) for i in range(REPLICAS)}
    router = Router(config, block_size=engines["d0"].config.block_size, hash_seed=engines["d0"].config.hash_seed)
    before = {rid: dict(e.stats().lora_loads) for rid, e in engines.items()}
    for rid, engine in engines.items():
        router.add_replica(DECODE, rid)
        report(router, rid, engine)
    rng = random.Random(5)
    names = sorted(paths)
    pending = [rng.choice(names) for _ in range(REQUESTS)]
    decisions, routed_to = {}, {rid: 0 for rid in engines}
    tokens, seconds, n = 0, 0.0, 0
    while pending or any(e.has_unfinished() for e in engines.values()):
        for adapter in pending[:PER_ROUND]:
            prompt = [(13 * n + 5 * j) % 500 + 5 for j in range(PROMPT)]
            decision = router.route(prompt, lora_adapter=adapter)
            rid = decision.decode_replica
            params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True, lora_adapter=adapter)
            engines[rid].add_request(prompt_token_ids=prompt, params=params, request_id=f"r{n}")
            decisions[f"r{n}"] = decision
            routed_to[rid] += 1
            n += 1
        pending = pending[PER_ROUND:]
        for rid, engine in engines.items():
            if engine.has_unfinished():
                start = time.perf_counter()
                outputs = engine.step()
                seconds += time.perf_counter() - start
                for out in outputs:
                    tokens += len(out.new_token_ids)
                    if out.finished:
                        decisions.pop(out.request_id).release_claims()
            report(router, rid, engine)
    loads: dict[str, int] = {}
    for rid, engine in engines.items():
        for tier, count in engine.stats().lora_loads.items():
            loads[tier] = loads.get(tier, 0) + count - before[rid].get(tier, 0)
    routed, hits = router.adapter_hit_counts()[DECODE]
    return {
        "loads_per_1000": {tier: 1000 * count / REQUESTS for tier, count in loads.items()},
        "adapter_hit_share": hits / routed,
        "requests_per_replica": sorted(routed_to.values(), reverse=True),
        "tokens_per_step_s": tokens / seconds,
    }


def measure(base: Path, paths: dict[str, str]) -> dict[str, dict]:
    """Each router over the same request sequence (the first ADAPTERS of paths)."""
    served = dict(list(paths.items())[:ADAPTERS])
    return {name: run_router(base, served, config) for name, config in ROUTERS.items()}


def section(results: dict[str, dict]) -> str:
    rows = [
        "| router | adapter loads per 1,000 requests | adapter-hit share | requests per replica | tok/s of step time |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        loads = ", ".join(f"{tier} {n:.0f}" for tier, n in sorted(r["loads_per_1000"].items()))
        per_replica = " / ".join(str(n) for n in r["requests_per_replica"])
        rows.append(
            f"| {name} | {loads} | {r['adapter_hit_share']:.2f} | {per_replica} | {r['tokens_per_step_s']:.0f} |"
        )
    return f"""## Adapter-aware routing against the plain KV router

{REPLICAS} replicas, each a real engine of the same model serving {ADAPTERS} adapters with
`max_loras` {SLOTS} and `max_cpu_loras` {CPU_SLOTS}, behind one Router fed each replica's KV
events and stats after every step (bench/engine/lora_routing.py, no Ray); {REQUESTS} requests
for the adapters in a seeded random order, {PER_ROUND} arriving per round, {PROMPT}-token
prompts and {OUTPUT} output tokens; the same sequence for each router.

{chr(10).join(rows)}
"""
