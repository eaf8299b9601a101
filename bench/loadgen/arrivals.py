"""Arrivals for a LoadPoint (records.py): open-loop Poisson offsets at a rate, closed-loop (all at
0), or the workload's own timing (trace replay), plus parsing of sweep lists like "1,2,4" or "inf"."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from splitserve.bench.loadgen.records import BenchRequest, LoadPoint, WorkloadError


def poisson_arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` req/s; the first request arrives at 0."""
    if num_requests < 0:
        raise WorkloadError("num_requests must be >= 0")
    if not rate > 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    if num_requests == 0:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def apply_load(requests: list[BenchRequest], load: LoadPoint, seed: int) -> list[BenchRequest]:
    """Requests with arrival offsets for `load`: Poisson for a rate, 0 for closed loop, kept
    unchanged for trace timing."""
    if load.mode == "trace-timing":
        return list(requests)
    if load.mode == "closed-loop":
        return [request.with_arrival(0.0) for request in requests]
    offsets = poisson_arrival_offsets(len(requests), load.rate, seed)
    return [request.with_arrival(offset) for request, offset in zip(requests, offsets)]


def _split(values: Iterable[str]) -> list[str]:
    return [part.strip() for value in values for part in str(value).split(",") if part.strip()]


def parse_rates(values: Iterable[str]) -> list[float]:
    """'2', '1,2,4' and 'inf', repeatable; sorted ascending, duplicates dropped."""
    rates = set()
    for part in _split(values):
        try:
            rate = float(part)
        except ValueError as exc:
            raise WorkloadError(f"bad rate {part!r}: expected a number or 'inf'") from exc
        if not rate > 0:
            raise WorkloadError(f"rate must be > 0, got {part!r}")
        rates.add(rate)
    return sorted(rates)


def parse_concurrencies(values: Iterable[str]) -> list[int]:
    levels = set()
    for part in _split(values):
        try:
            level = int(part)
        except ValueError as exc:
            raise WorkloadError(f"bad concurrency {part!r}: expected an integer") from exc
        if level < 1:
            raise WorkloadError(f"concurrency must be >= 1, got {part!r}")
        levels.add(level)
    return sorted(levels)


def build_load_points(rates: list[float], concurrencies: list[int], default: LoadPoint) -> list[LoadPoint]:
    """Rates sweep as open loop (a single concurrency value then caps in-flight requests);
    concurrencies alone sweep closed loop; neither gives `default`."""
    if rates:
        if len(concurrencies) > 1:
            raise WorkloadError("with --rate, give at most one --concurrency (the in-flight cap)")
        cap = concurrencies[0] if concurrencies else None
        return [LoadPoint(rate=rate, concurrency=cap) for rate in rates]
    if concurrencies:
        return [LoadPoint(concurrency=level) for level in concurrencies]
    return [default]
