"""Metrics of benchmark runs: latency percentiles, throughput, cache hits, SLO attainment, goodput.

Definitions (all latencies from the moment the request was sent):
  TTFT  first token-bearing chunk - send.
  ITL   gaps between consecutive token-bearing chunks, pooled over all requests (a chunk that
        carries several tokens is one gap: this is what a streaming user sees).
  E2E   end of stream - send.  TPOT (E2E - TTFT) / (completion tokens - 1), per request.
  output tokens/s and requests/s  over successful requests, divided by the run's wall time.
  cached-token share  sum cached_tokens / sum prompt_tokens over successful requests whose usage
        reports cached tokens (None when the server reports none).
  SLO attainment  fraction of finished requests (ok or failed; not those cut off by the run's
        wall-time bound) with TTFT <= ttft_ms AND per-request ITL <= itl_ms, where a request's
        ITL is the p90 (default) or the mean of its own gaps; a request with a single chunk has
        no gaps and passes the ITL part. Failed requests never attain.
  goodput  the highest swept rate whose SLO attainment is >= the threshold (0.9).
  first-token stages  (a splitserve server, --first-token-stages) each stage of the requests
        that report them, and `outside`: the client's TTFT less their sum (its connection, the
        proxy, the first event's rendering and delivery: what no stage holds).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from splitserve.bench.loadgen.records import RequestRecord, RunResult

ITL_STATISTICS = ("p90", "mean")
GOODPUT_ATTAINMENT = 0.9


@dataclass(frozen=True)
class SloTarget:
    ttft_ms: float
    itl_ms: float
    itl_statistic: str = "p90"
    attainment_threshold: float = GOODPUT_ATTAINMENT

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.itl_ms > 0):
            raise ValueError("SLO targets must be > 0 ms")
        if self.itl_statistic not in ITL_STATISTICS:
            raise ValueError(f"itl_statistic must be one of {ITL_STATISTICS}, got {self.itl_statistic!r}")
        if not 0 < self.attainment_threshold <= 1:
            raise ValueError("attainment_threshold must be in (0, 1]")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LatencySummary:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        if len(values) == 0:
            return cls(0, None, None, None, None)
        array = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(array, [50, 90, 99]).tolist()
        return cls(len(array), float(array.mean()), p50, p90, p99)


@dataclass(frozen=True)
class RunMetrics:
    num_recorded: int
    num_ok: int
    num_failed: int
    num_unfinished: int
    num_not_sent: int
    errors_by_kind: dict[str, int]
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_prompt_tokens: int
    total_completion_tokens: int
    total_cached_tokens: int | None
    cached_token_share: float | None
    ttft_ms: LatencySummary
    itl_ms: LatencySummary
    e2e_ms: LatencySummary
    tpot_ms: LatencySummary
    slo_attainment: float | None
    # stage -> its summary in ms, over the successful requests that reported stages, in the
    # order the server listed them, then "outside"; empty when none did.
    first_token_stages_ms: dict[str, LatencySummary] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


OUTSIDE_STAGES = "outside"


def first_token_stage_summaries(records: Sequence[RequestRecord]) -> dict[str, LatencySummary]:
    """Each first-token stage over the requests that report stages (a stage a request did not
    go through, as handoff on a local prefill, counts only where it was), and `outside`."""
    staged = [record for record in records if record.first_token_stages and record.ttft_s is not None]
    names = list(dict.fromkeys(stage for record in staged for stage in record.first_token_stages))
    summaries = {
        stage: LatencySummary.of(_to_ms(r.first_token_stages[stage] for r in staged if stage in r.first_token_stages))
        for stage in names
    }
    if staged:
        outside = (record.ttft_s - sum(record.first_token_stages.values()) for record in staged)
        summaries[OUTSIDE_STAGES] = LatencySummary.of(_to_ms(outside))
    return summaries


def _to_ms(values: Iterable[float]) -> list[float]:
    return [1000.0 * value for value in values]


def request_itl_ms(record: RequestRecord, statistic: str) -> float | None:
    """One request's ITL figure: p90 or mean of its own gaps; None when it has no gaps."""
    gaps = record.itl_gaps_s
    if not gaps:
        return None
    if statistic == "mean":
        return 1000.0 * float(np.mean(gaps))
    if statistic == "p90":
        return 1000.0 * float(np.percentile(gaps, 90))
    raise ValueError(f"itl statistic must be one of {ITL_STATISTICS}, got {statistic!r}")


def request_tpot_ms(record: RequestRecord) -> float | None:
    if record.ttft_s is None or record.e2e_s is None or record.num_output_tokens < 2:
        return None
    return 1000.0 * (record.e2e_s - record.ttft_s) / (record.num_output_tokens - 1)


def meets_slo(record: RequestRecord, slo: SloTarget) -> bool:
    if not record.ok or 1000.0 * record.ttft_s > slo.ttft_ms:
        return False
    itl = request_itl_ms(record, slo.itl_statistic)
    return itl is None or itl <= slo.itl_ms


def slo_attainment(records: Iterable[RequestRecord], slo: SloTarget) -> float | None:
    finished = [record for record in records if not record.unfinished]
    if not finished:
        return None
    return sum(meets_slo(record, slo) for record in finished) / len(finished)


def compute_goodput(
    points: Iterable[tuple[float, float | None]], threshold: float = GOODPUT_ATTAINMENT
) -> float | None:
    """Highest rate among (rate, attainment) points whose attainment >= threshold; None if none."""
    passing = [rate for rate, attainment in points if attainment is not None and attainment >= threshold]
    return max(passing) if passing else None


def compute_run_metrics(run: RunResult, slo: SloTarget | None = None) -> RunMetrics:
    records = run.records
    ok = [record for record in records if record.ok]
    unfinished = [record for record in records if record.unfinished]
    errors = Counter(record.error_key for record in records if not record.ok)
    with_cache = [record for record in ok if record.cached_tokens is not None]
    cache_prompt = sum(record.prompt_tokens or record.num_prompt_tokens_sent for record in with_cache)
    total_cached = sum(record.cached_tokens for record in with_cache) if with_cache else None
    duration = run.duration_s if run.duration_s > 0 else math.nan
    total_completion = sum(record.num_output_tokens for record in ok)
    return RunMetrics(
        num_recorded=len(records),
        num_ok=len(ok),
        num_failed=len(records) - len(ok) - len(unfinished),
        num_unfinished=len(unfinished),
        num_not_sent=run.num_not_sent,
        errors_by_kind=dict(sorted(errors.items())),
        duration_s=run.duration_s,
        requests_per_s=len(ok) / duration,
        output_tokens_per_s=total_completion / duration,
        total_prompt_tokens=sum(record.prompt_tokens or record.num_prompt_tokens_sent for record in ok),
        total_completion_tokens=total_completion,
        total_cached_tokens=total_cached,
        cached_token_share=(total_cached / cache_prompt) if with_cache and cache_prompt else None,
        ttft_ms=LatencySummary.of(_to_ms(record.ttft_s for record in ok)),
        itl_ms=LatencySummary.of(_to_ms(gap for record in ok for gap in record.itl_gaps_s)),
        e2e_ms=LatencySummary.of(_to_ms(record.e2e_s for record in ok)),
        tpot_ms=LatencySummary.of([t for t in map(request_tpot_ms, ok) if t is not None]),
        slo_attainment=None if slo is None else slo_attainment(records, slo),
        first_token_stages_ms=first_token_stage_summaries(ok),
    )
