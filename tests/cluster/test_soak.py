"""Sustained load on a real `splitserve serve` (1P+1D, CPU, 127.0.0.1): many concurrent
streaming clients for a bounded time. Nothing lost (every stream ends with its finish reason
and [DONE]), nothing unexpected (429 under overload is expected and counted), resident
memory of the whole serve process tree flat after warm-up, block pools back to baseline.

    pytest tests/cluster/test_soak.py                                    # CI: 32 clients x 30 s
    SPLITSERVE_SOAK_SECONDS=1800 pytest -m slow tests/cluster/test_soak.py   # the long soak
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.serve_process import ServeProcess

pytestmark = pytest.mark.e2e  # each test starts `splitserve serve` (in soak())
NUM_CLIENTS = 32
CI_SECONDS = 30.0
MAX_QUEUED = 24  # < NUM_CLIENTS: the frontend must shed load with 429, not queue it
MAX_RSS_GROWTH = 0.15  # between the end of warm-up (1/3 of the run) and the end
# Prompt families with shared prefixes (the KV router's and prefix caches' normal case).
TOPICS = ["the history of the printing press", "how tides work", "a recipe for bread", "the rules of chess"]


@dataclass
class SoakReport:
    num_ok: int = 0
    num_429: int = 0
    num_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    # (seconds since start, {process: resident bytes}) for the serve process and its descendants
    rss_samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    def rss_at(self, start_s: float, end_s: float) -> float:
        values = [sum(by_proc.values()) for t, by_proc in self.rss_samples if start_s <= t <= end_s]
        return statistics.median(values) if values else float("nan")

    def top_growers(self, warm_s: float, num: int = 3) -> str:
        """The processes whose RSS grew most between the end of warm-up and the end."""
        warm = min(self.rss_samples, key=lambda sample: abs(sample[0] - warm_s))[1]
        end = self.rss_samples[-1][1]
        growth = sorted(((end[p] - warm[p], p) for p in end.keys() & warm.keys()), reverse=True)[:num]
        return ", ".join(f"{p} {delta / 2**20:+.1f} MiB" for delta, p in growth)


def tree_rss(pid: int) -> dict[str, int]:
    """Resident bytes of a process and each of its descendants (Ray's GCS, raylet, workers...)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    by_proc = {}
    for proc in procs:
        try:
            by_proc[f"{proc.name()}[{proc.pid}]"] = proc.memory_info().rss
        except psutil.Error:
            pass
    return by_proc


def listening_hosts(pid: int, port: int) -> set[str]:
    """The addresses the serve process tree listens on at `port`."""
    pids = {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
    return {
        conn.laddr.ip
        for conn in psutil.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid in pids
    }


def _is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # "::ffff:127.0.0.1" too


async def one_request(http: httpx.AsyncClient, model: str, rng: random.Random, report: SoakReport) -> None:
    topic = rng.choice(TOPICS)
    max_tokens = rng.randint(4, 24)
    common = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1000),
        "stream_options": {"include_usage": True},
    }
    if rng.random() < 0.7:
        path, body = "/v1/completions", {**common, "prompt": f"Write about {topic}. Part {rng.randrange(50)}:"}
    else:
        path, body = (
            "/v1/chat/completions",
            {
                **common,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"Tell me about {topic}, point {rng.randrange(50)}."},
                ],
            },
        )
    async with http.stream("POST", path, json=body) as resp:
        if resp.status_code == 429:
            report.num_429 += 1
            await resp.aread()
            await asyncio.sleep(rng.uniform(0.05, 0.25))
            return
        if resp.status_code != 200:
            report.errors.append(f"{path}: HTTP {resp.status_code} {(await resp.aread())[:200]!r}")
            return
        events = [line[len("data: ") :] async for line in resp.aiter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        report.errors.append(f"{path}: stream ended without [DONE] after {len(events)} events")
        return
    chunks = [json.loads(e) for e in events[:-1]]
    failures = [c["error"] for c in chunks if "error" in c]
    finish = [ch["finish_reason"] for c in chunks for ch in c.get("choices", ()) if ch.get("finish_reason")]
    usage = chunks[-1].get("usage") if chunks else None
    if failures or len(finish) != 1 or not usage or not 1 <= usage["completion_tokens"] <= max_tokens:
        report.errors.append(f"{path}: bad stream: errors={failures} finish={finish} usage={usage}")
        return
    report.num_ok += 1
    report.num_tokens += usage["completion_tokens"]


async def run_clients(base_url: str, duration_s: float, report: SoakReport) -> None:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 4, max_keepalive_connections=NUM_CLIENTS + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        stop_at = time.monotonic() + duration_s

        async def client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < stop_at:
                try:
                    await one_request(http, model, rng, report)
                except (httpx.HTTPError, ValueError, KeyError) as exc:  # a hang ends as a timeout here
                    report.errors.append(f"client {i}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(client(i) for i in range(NUM_CLIENTS)))


def metric_samples(base_url: str) -> dict[str, list]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def pools_at_baseline(base_url: str) -> bool:
    samples = metric_samples(base_url)
    usage = [s.value for s in samples.get("splitserve_kv_block_usage", [])]
    inflight = [s.value for s in samples.get("splitserve_frontend_inflight_requests", [])]
    running = [s.value for s in samples.get("splitserve_running_requests", [])]
    return len(usage) == 2 and not any(usage) and not any(inflight) and not any(running)


def soak(tiny_model: str, log_dir, duration_s: float) -> SoakReport:
    server = ServeProcess(
        tiny_model,
        log_dir / "serve.log",
        "--prefill-replicas",
        "1",
        "--decode-replicas",
        "1",
        "--router",
        "kv",
        "--max-queued-requests",
        str(MAX_QUEUED),
    )
    report = SoakReport()
    try:
        for port in (server.http_port, server.grpc_port):  # the default: loopback only
            hosts = listening_hosts(server.proc.pid, port)
            assert hosts and all(_is_loopback(h) for h in hosts), f"port {port} listens on {hosts}"
        stop = threading.Event()
        started = time.monotonic()

        def sample_rss() -> None:
            while not stop.wait(1.0):
                report.rss_samples.append((time.monotonic() - started, tree_rss(server.proc.pid)))

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        asyncio.run(asyncio.wait_for(run_clients(server.base_url, duration_s, report), duration_s + 120))
        stop.set()
        sampler.join(5)
        deadline = time.monotonic() + 20
        while not pools_at_baseline(server.base_url):
            assert time.monotonic() < deadline, f"block pools not back to baseline: {metric_samples(server.base_url)}"
            time.sleep(0.2)
        statuses = {
            s.labels["status"]: s.value
            for s in metric_samples(server.base_url)["splitserve_requests"]
            if s.name.endswith("_total")
        }
        report.errors += [
            f"server counted {n:.0f} requests with status {status}"
            for status, n in statuses.items()
            if status not in ("ok", "overloaded")
        ]
        assert server.proc.poll() is None, "the server died during the soak"
    finally:
        assert server.stop() == 0, server.log_path.read_text()[-3000:]
    return report


def check(report: SoakReport, duration_s: float) -> None:
    warm, end = duration_s / 3, duration_s
    rss_warm, rss_end = report.rss_at(warm - 2, warm + 2), report.rss_at(end - 4, end)
    growth = rss_end / rss_warm - 1
    print(
        f"soak: {NUM_CLIENTS} clients x {duration_s:.0f} s: {report.num_ok} streams ok "
        f"({report.num_tokens} tokens), {report.num_429} x 429, {len(report.errors)} unexpected errors; "
        f"tree RSS {rss_warm / 2**20:.0f} MiB after warm-up -> {rss_end / 2**20:.0f} MiB at the end "
        f"({100 * growth:+.1f}%); grew most: {report.top_growers(warm)}"
    )
    assert not report.errors, report.errors[:10]
    assert report.num_ok >= NUM_CLIENTS, "the server completed almost nothing"
    assert growth < MAX_RSS_GROWTH, f"resident memory grew {100 * growth:.1f}% after warm-up"


@pytest.mark.timeout(420)
def test_soak_short(tiny_model, tmp_path):
    report = soak(tiny_model, tmp_path, CI_SECONDS)
    check(report, CI_SECONDS)


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_soak_long(tiny_model, tmp_path, request):
    """Runs when slow tests are selected (-m slow) or SPLITSERVE_SOAK_SECONDS is set."""
    seconds = os.environ.get("SPLITSERVE_SOAK_SECONDS")
    markexpr = request.config.getoption("-m") or ""
    if seconds is None and ("slow" not in markexpr or "not slow" in markexpr):
        pytest.skip("the long soak runs with -m slow or SPLITSERVE_SOAK_SECONDS=N")
    duration_s = float(seconds or 600)
    report = soak(tiny_model, tmp_path, duration_s)
    check(report, duration_s)
