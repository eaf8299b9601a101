"""Prometheus families of the Batch API, in the ingress replica's registry (merged over every
ingress by the controller). Jobs by status are set only by the replica holding the runner lease."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from splitserve.cluster.metric_families import ModelFamilies
from splitserve.cluster.state.records import FINISHED, UNFINISHED


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        f = ModelFamilies(registry, model_name)
        self.jobs = f.gauge(
            "splitserve_batch_jobs", "Batch jobs in the state store by status (lease holder only)", "status"
        )
        self.lines = f.counter(
            "splitserve_batch_lines", "Batch lines finished, by result: completed or failed", "result"
        )
        self.tokens = f.counter(
            "splitserve_batch_generation_tokens", "Tokens generated for batch lines (rate: batch tokens/s)"
        )
        self.line_retries = f.counter(
            "splitserve_batch_line_retries", "Batch lines refused for lack of headroom and retried later"
        )
        self.concurrency = f.gauge("splitserve_batch_concurrency", "Batch lines this replica may have in flight now")

    def set_jobs(self, counts: dict[str, int]) -> None:
        for status in (*UNFINISHED, *FINISHED):
            self.jobs.labels(status).set(counts.get(status, 0))
