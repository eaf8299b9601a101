"""IngressReporter: builds the IngressReport an ingress sends with each membership call --
its in-flight requests per replica (from the dispatcher), the TTFT / ITL samples observed
since the previous report, and its Prometheus samples about once a second."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry

from splitserve.proto.messages.ingress_report import IngressReport, families_of

MAX_SAMPLES = 2048  # per kind and report: under heavy load the newest samples are enough


class IngressReporter:
    def __init__(self, registry: CollectorRegistry | None = None, metrics_every_s: float = 1.0):
        self.registry = registry
        self.metrics_every_s = metrics_every_s
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._itl: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._lock = threading.Lock()
        self._metrics_sent_at = float("-inf")

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.append((time.monotonic(), seconds))

    def observe_itls(self, seconds: list[float]) -> None:
        """Inter-chunk gaps of one request, one per chunk, handed over in batches
        (TokenMeter): stamped now, at most a batch's tokens after they were seen."""
        with self._lock:
            now = time.monotonic()
            self._itl.extend([(now, gap) for gap in seconds])

    def report(self, inflight: dict[str, int]) -> bytes:
        now = time.monotonic()
        with self._lock:
            ttft = [(now - t, v) for t, v in self._ttft]
            itl = [(now - t, v) for t, v in self._itl]
            self._ttft.clear()
            self._itl.clear()
        metrics = None
        if self.registry is not None and now - self._metrics_sent_at >= self.metrics_every_s:
            metrics, self._metrics_sent_at = families_of(self.registry), now
        return IngressReport(inflight=inflight, ttft=ttft, itl=itl, metrics=metrics).to_bytes()
