"""Prometheus families labelled `model_name` first, as vLLM's are: what the ingress's metrics
(cluster/frontend/metrics.py) and the controller's pool series (cluster/control/pool_metrics.py)
are both made with. Here, not in frontend/, so control/ imports no frontend/."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ModelLabeled:
    """A labelled metric whose model_name label is bound once: .labels(*rest) fills the others."""

    def __init__(self, metric, model_name: str):
        self.metric = metric
        self.model_name = model_name

    def labels(self, *values: str):
        return self.metric.labels(self.model_name, *values)

    def remove(self, *values: str) -> None:
        self.metric.remove(self.model_name, *values)

    def describe(self):
        return self.metric.describe()


class ModelFamilies:
    """Makes families in one registry, each labelled model_name first (bound once)."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry, self.model_name = registry, model_name

    def counter(self, name: str, doc: str, *labels: str):
        return self._bind(Counter(name, doc, ["model_name", *labels], registry=self.registry), labels)

    def gauge(self, name: str, doc: str, *labels: str):
        return self._bind(Gauge(name, doc, ["model_name", *labels], registry=self.registry), labels)

    def histogram(self, name: str, doc: str, buckets=LATENCY_BUCKETS):
        return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(self.model_name)

    def labeled_histogram(self, name: str, doc: str, *labels: str, buckets=LATENCY_BUCKETS) -> ModelLabeled:
        metric = Histogram(name, doc, ["model_name", *labels], registry=self.registry, buckets=buckets)
        return ModelLabeled(metric, self.model_name)

    def _bind(self, metric, labels: tuple[str, ...]):
        return ModelLabeled(metric, self.model_name) if labels else metric.labels(self.model_name)
