"""MetricsScraper: samples one Prometheus metric per replica from a server's /metrics while a
run is in progress, in a background thread, giving replica -> [(seconds, value)]."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.loadgen.records import ReplicaSamples


def parse_replica_values(text: str, metric_name: str, replica_label: str) -> dict[str, float]:
    """Values of `metric_name` samples keyed by their `replica_label` (samples without that label
    are keyed by all their labels, or 'all'); a replica with several samples is summed."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != metric_name:
                continue
            labels = sample.labels
            key = labels.get(replica_label) or ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "all"
            values[key] = values.get(key, 0.0) + float(sample.value)
    return values


class MetricsScraper:
    def __init__(
        self,
        base_url: str,
        metric_name: str,
        replica_label: str = "replica",
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        api_key: str | None = None,
    ) -> None:
        if not (interval_s > 0 and timeout_s > 0):
            raise ValueError("interval_s and timeout_s must be > 0")
        self.base_url = base_url.rstrip("/")
        self.metric_name = metric_name
        self.replica_label = replica_label
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.samples: ReplicaSamples = {}
        self.num_failures = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.perf_counter()

    def scrape_once(self, http: httpx.Client) -> None:
        now = time.perf_counter() - self._start
        try:
            response = http.get("/metrics")
            response.raise_for_status()
            values = parse_replica_values(response.text, self.metric_name, self.replica_label)
        except (httpx.HTTPError, ValueError) as exc:
            self.num_failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return
        for replica, value in values.items():
            self.samples.setdefault(replica, []).append((now, value))

    def _loop(self) -> None:
        # At least one sample at the start and one at the stop, however short the run: a run
        # that ends before the thread is first scheduled still records the replicas' load.
        with httpx.Client(base_url=self.base_url, timeout=self.timeout_s, headers=self.headers) as http:
            while True:
                self.scrape_once(http)
                if self._stop.wait(self.interval_s):
                    self.scrape_once(http)
                    return

    def start(self) -> MetricsScraper:
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> ReplicaSamples:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + self.interval_s + 1.0)
        return self.samples

    def __enter__(self) -> MetricsScraper:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
