"""Side-by-side runs: the same workload and load points against each named configuration.

A configuration is a URL (benchmarked as is) or a command that starts a server: it is launched
with ManagedServer on a free port in its own process group, benchmarked once healthy, and
stopped by its process group before the next configuration starts, so configurations never
share the machine.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve.bench.loadgen.arrivals import apply_load
from splitserve.bench.loadgen.client import BenchClient, EndpointError, PromptTextRenderer
from splitserve.bench.loadgen.managed_server import ManagedServer, ServerStartError
from splitserve.bench.loadgen.metrics import SloTarget, compute_goodput, compute_run_metrics
from splitserve.bench.loadgen.metrics_scraper import MetricsScraper
from splitserve.bench.loadgen.records import BenchRequest, ClientOptions, ConfigResult, LoadPoint, ServerConfig
from splitserve.bench.loadgen.report import safe_filename
from splitserve.bench.loadgen.workloads import Workload


@dataclass(frozen=True)
class BenchPlan:
    """What every configuration is run with. With `fresh_prompts_per_load` each load point gets
    prompts from seed + its index, so a server's prefix cache warmed by one load point does not
    flatter the next; every configuration still sees identical requests."""

    workload: Workload
    loads: tuple[LoadPoint, ...]
    client: ClientOptions
    seed: int = 0
    fresh_prompts_per_load: bool = True
    slo: SloTarget | None = None
    scrape_metric: str | None = None
    replica_label: str = "replica"
    scrape_interval_s: float = 1.0
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.loads:
            raise ValueError("a bench plan needs at least one load point")

    def requests_for(self, load_index: int) -> list[BenchRequest]:
        seed = self.seed + load_index if self.fresh_prompts_per_load else self.seed
        requests = self.workload.generate(seed)
        return apply_load(requests, self.loads[load_index], seed=self.seed + load_index)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_loads(
    name: str, base_url: str, plan: BenchPlan, result: ConfigResult, text_renderer: PromptTextRenderer | None = None
) -> None:
    """Run every load point of `plan` against `base_url`, appending to `result`."""
    client = BenchClient(dataclasses.replace(plan.client, base_url=base_url), text_renderer)
    for index, load in enumerate(plan.loads):
        _log(f"{name}: {load.label} against {base_url}")
        requests = plan.requests_for(index)
        scraper = None
        if plan.scrape_metric:
            scraper = MetricsScraper(
                base_url, plan.scrape_metric, plan.replica_label, plan.scrape_interval_s, api_key=plan.client.api_key
            ).start()
        try:
            run = client.run(requests, load, config_name=name)
        finally:
            samples = scraper.stop() if scraper is not None else {}
        if scraper is not None and not samples:
            _log(f"{name}: no samples of {plan.scrape_metric} from {base_url}/metrics ({scraper.last_error})")
        metrics = compute_run_metrics(run, plan.slo)
        result.runs.append(run)
        result.metrics.append(metrics)
        result.replica_samples.append(samples)
        _log(
            f"{name}: {load.label}: {metrics.num_ok} ok, {metrics.num_failed} failed, "
            f"{metrics.requests_per_s:.2f} req/s"
        )
    if plan.slo is not None:
        result.goodput_rps = compute_goodput(
            (
                (run.load.rate, m.slo_attainment)
                for run, m in zip(result.runs, result.metrics)
                if run.load.rate is not None
            ),
            plan.slo.attainment_threshold,
        )


def run_config(config: ServerConfig, plan: BenchPlan, text_renderer: PromptTextRenderer | None = None) -> ConfigResult:
    """Benchmark one configuration; a server that fails to start or answer is recorded in
    ConfigResult.error rather than raised, so the other configurations still run."""
    result = ConfigResult(name=config.name, target=config.target)
    try:
        if config.url is not None:
            run_loads(config.name, config.url, plan, result, text_renderer)
            return result
        log_path = None if plan.log_dir is None else plan.log_dir / f"{safe_filename(config.name)}.server.log"
        server = ManagedServer(
            config.command,
            startup_timeout_s=plan.startup_timeout_s,
            stop_timeout_s=plan.stop_timeout_s,
            log_path=log_path,
        )
        _log(f"{config.name}: starting {config.command}")
        with server:
            _log(f"{config.name}: healthy at {server.base_url} (pid {server.pid})")
            run_loads(config.name, server.base_url, plan, result, text_renderer)
        _log(f"{config.name}: stopped pid {server.pid} (exit code {server.process.returncode})")
    except (ServerStartError, EndpointError) as exc:
        result.error = str(exc).splitlines()[0]
        _log(f"{config.name}: {exc}")
    return result


def run_comparison(
    configs: Sequence[ServerConfig], plan: BenchPlan, text_renderer: PromptTextRenderer | None = None
) -> list[ConfigResult]:
    names = [config.name for config in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must be unique, got {names}")
    return [run_config(config, plan, text_renderer) for config in configs]
