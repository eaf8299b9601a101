"""ConfigResult: every run of one named configuration (a server URL or a server command)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.bench.metrics import RunMetrics
from splitserve.bench.run_result import RunResult

# replica name -> [(seconds since scraping began just before the run, value)], e.g. a gauge
# scraped from /metrics.
ReplicaSamples = dict[str, list[tuple[float, float]]]


@dataclass
class ConfigResult:
    name: str
    target: str  # the URL benchmarked, or the command that started the server
    runs: list[RunResult] = field(default_factory=list)
    metrics: list[RunMetrics] = field(default_factory=list)
    replica_samples: list[ReplicaSamples] = field(default_factory=list)  # one per run, maybe empty
    goodput_rps: float | None = None
    error: str | None = None  # why the configuration could not be benchmarked

    def to_dict(self, include_records: bool = True) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "error": self.error,
            "goodput_rps": self.goodput_rps,
            "runs": [
                {
                    **run.to_dict(include_records=include_records),
                    "metrics": metrics.to_dict(),
                    "replica_samples": samples,
                }
                for run, metrics, samples in zip(self.runs, self.metrics, self._samples_per_run())
            ],
        }

    def _samples_per_run(self) -> list[ReplicaSamples]:
        return self.replica_samples + [{}] * (len(self.runs) - len(self.replica_samples))
