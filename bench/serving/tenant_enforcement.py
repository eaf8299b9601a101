"""The cost of tenant enforcement at the ingress, and the limits held under load.

  python -m splitserve.bench.serving.tenant_enforcement [--requests 20000] [--out bench/results/tenants.md]

Cost: the enforcement of one request as an ingress runs it (key lookup among 1,000 tenants or
1, admission against requests/min, tokens/min and a budget, x-ratelimit headers, settling,
usage metering, and the lease round trips to a SQLite state store), driven by 32 concurrent
asyncio clients in one process; CPU seconds per request (process time) and the wall p50 of
admission. Limits: 256 concurrent clients over two limiters (two ingress replicas) sharing one
store, against a requests/min limit and a token budget: admitted vs the limit (overshoot).
In-process: it does not include HTTP, tokenization or generation (the full request's ingress
CPU is in bench/results/splitserve_vs_vllm.md for scale).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from splitserve.bench import RESULTS_DIR
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.state.database import open_state_engine
from splitserve.cluster.tenants.sql_quota_authority import SqlQuotaAuthority
from splitserve.cluster.tenants.tenant_config import TenantConfig
from splitserve.cluster.tenants.tenant_gate import TenantGate
from splitserve.cluster.tenants.tenant_limiter import TenantLimiter
from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal

DEFAULT_OUT = RESULTS_DIR / "tenants.md"
LIMITS = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "budget_tokens": 10**13}


async def _cost(num_tenants: int, num_requests: int, concurrency: int, state_dir: Path) -> dict:
    tenants = [{"name": f"t{i}", "api_keys": [f"sk-{i}"], **LIMITS} for i in range(num_tenants)]
    cfg = ServeConfig(tenants=tenants)
    gate = TenantGate(
        cfg, open_state_engine(f"sqlite:///{state_dir / 'cost.db'}"), "bench", TenantMetrics(CollectorRegistry())
    )
    result = {"tenants": num_tenants}
    # Cold: every tenant's first requests lease capacity from the store (3 limits each);
    # warm: the same requests again, on the leases already held (the steady state).
    for phase in ("cold", "warm"):
        latencies: list[float] = []
        queue = list(range(num_requests))

        async def client(queue: list[int] = queue, latencies: list[float] = latencies) -> None:
            while queue:
                i = queue.pop()
                start = time.perf_counter()
                ticket = await gate.admit(f"sk-{i % num_tenants}", "m", 100, 200)
                latencies.append(time.perf_counter() - start)
                part = ticket.part(0)
                part.started()
                part.finished(cached=50, completion=150, failed=False)
                ticket.close()

        cpu = time.process_time()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        await gate.tick()  # one sync: leases renewed, usage written
        result[f"{phase}_cpu_us"] = 1e6 * (time.process_time() - cpu) / num_requests
        result[f"{phase}_p50_us"] = 1e6 * statistics.median(latencies)
    await gate.close()
    return result


async def _overshoot(clients: int, state_dir: Path) -> dict:
    authority = SqlQuotaAuthority(open_state_engine(f"sqlite:///{state_dir / 'limits.db'}"))
    replicas = [TenantLimiter(authority, f"ingress-{i}", lease_fraction=0.1) for i in range(2)]
    rpm = TenantConfig(name="rpm", api_keys=["k"], requests_per_minute=1000)
    budget = TenantConfig(name="budget", api_keys=["k2"], budget_tokens=100_000, budget_period="day")
    counts = {"rpm": 0, "budget": 0}

    async def client(i: int) -> None:
        replica = replicas[i % 2]
        for tenant, tokens in ((rpm, 0.0), (budget, 1000.0)):
            for _ in range(10):
                try:
                    await replica.admit(tenant, tokens)  # held: long streams that never finish
                    counts[tenant.name] += 1
                except TenantRefusal:
                    pass

    await asyncio.gather(*(client(i) for i in range(clients)))
    return {"rpm_admitted": counts["rpm"], "budget_reserved": counts["budget"] * 1000}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [asyncio.run(_cost(n, args.requests, 32, Path(tmp))) for n in (1, 1000)]
        limits = asyncio.run(_overshoot(256, Path(tmp)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "python -m splitserve.bench.serving.tenant_enforcement " + " ".join(argv if argv is not None else [])
    lines = [
        "| tenants configured | CPU per request, cold (µs) | CPU per request, warm (µs) | admission p50, warm (µs) |",
        "|---:|---:|---:|---:|",
        *(
            f"| {r['tenants']} | {r['cold_cpu_us']:.1f} | {r['warm_cpu_us']:.1f} | {r['warm_p50_us']:.1f} |"
            for r in rows
        ),
        "",
        "| 256 clients, 2 replicas, 1 store | limit | admitted / reserved | overshoot |",
        "|---|---:|---:|---:|",
        f"| requests/min | 1000 | {limits['rpm_admitted']} | {max(0, limits['rpm_admitted'] - 1000)} |",
        f"| budget tokens (1,000 per request, held) | 100000 | {limits['budget_reserved']} | "
        f"{max(0, limits['budget_reserved'] - 100_000)} |",
    ]
    print("\n".join(lines))
    print(f"\ncommit {commit}; command: {command.strip()}")


if __name__ == "__main__":
    main()
