"""Load points: open-loop Poisson arrivals at a rate, closed-loop fixed concurrency, or the
workload's own timing (trace replay), plus parsing of sweep lists like "1,2,4" or "inf"."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.bench_request import BenchRequest, WorkloadError


@dataclass(frozen=True)
class LoadPoint:
    """How requests are offered to the server during one run.

    rate set: open loop, Poisson arrivals at `rate` req/s (inf = all at t=0); `concurrency`, if
    also set, caps requests in flight (later arrivals queue). rate unset, concurrency set: closed
    loop, `concurrency` requests always in flight. Neither: open loop at the requests' own
    arrival offsets (trace timestamps).
    """

    rate: float | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"rate must be > 0 (or inf), got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def mode(self) -> str:
        if self.rate is not None:
            return "poisson"
        return "closed-loop" if self.concurrency is not None else "trace-timing"

    @property
    def label(self) -> str:
        if self.rate is not None:
            text = f"rate={self.rate:g}"
            return text if self.concurrency is None else f"{text},cap={self.concurrency}"
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        return "trace-timing"

    def to_dict(self) -> dict[str, Any]:
        rate = None if self.rate is None else ("inf" if math.isinf(self.rate) else self.rate)
        return {"mode": self.mode, "rate": rate, "concurrency": self.concurrency, "label": self.label}


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
