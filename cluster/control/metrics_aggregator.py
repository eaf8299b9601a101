"""MetricsAggregator: one Prometheus view of a deployment with many ingress replicas.

Each ingress has its own registry (requests, TTFT, ITL, tokens ...) and ships its samples to
the controller about once a second; a scrape of /metrics lands on any one ingress, which
renders this merged view. Counters and histograms are summed over the ingresses; gauges too
(in-flight requests add up). An ingress that went away has its last samples of cumulative
families folded into a retired base, so totals never go down when an ingress is replaced
(they do restart from zero with the controller, which Prometheus reads as a counter reset).
The controller's own registry (pool series: replicas, KV usage, transfers, scaling) is
rendered alongside.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from splitserve.cluster.scaling.load_forecast import DemandTotals
from splitserve.proto.messages.ingress_report import MetricFamily, families_of

CUMULATIVE = frozenset({"counter", "histogram", "summary"})
# Retired ingresses kept one by one, so one that was only presumed gone can come back
# without being counted twice; older ones are folded into one base.
MAX_RETIRED = 64

_Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


class MetricsAggregator:
    def __init__(self):
        self._live: dict[str, list[MetricFamily]] = {}
        self._retired: dict[str, dict[str, dict[_Key, float]]] = {}  # ingress -> family -> sample -> value
        self._base: dict[str, dict[_Key, float]] = {}
        self._meta: dict[str, tuple[str, str]] = {}  # family -> (type, documentation)

    @property
    def ingress_ids(self) -> list[str]:
        return list(self._live)

    def update(self, ingress_id: str, families: list[MetricFamily]) -> None:
        """An ingress's current samples (replacing its previous ones)."""
        self._retired.pop(ingress_id, None)  # presumed gone, but it was not: count it once
        self._live[ingress_id] = families
        for family in families:
            self._meta.setdefault(family.name, (family.type, family.documentation))

    def retire(self, ingress_id: str) -> None:
        """The ingress is gone: keep what its counters and histograms had counted."""
        families = self._live.pop(ingress_id, None)
        if not families:
            return
        self._retired[ingress_id] = {
            f.name: _sum_into({}, f.samples) for f in families if f.type in CUMULATIVE and f.samples
        }
        while len(self._retired) > MAX_RETIRED:
            oldest = next(iter(self._retired))
            for name, samples in self._retired.pop(oldest).items():
                target = self._base.setdefault(name, {})
                for key, value in samples.items():
                    target[key] = target.get(key, 0.0) + value

    def sample_total(self, sample_name: str, model_name: str) -> float:
        """One sample summed over every ingress, live and gone, for one model (e.g.
        splitserve_prompt_tokens_total): what the `sla` autoscaling policy reads its demand from."""

        def matching(samples: dict[_Key, float]) -> float:
            return sum(
                v
                for (name, labels), v in samples.items()
                if name == sample_name and ("model_name", model_name) in labels
            )

        total = sum(matching(samples) for samples in self._base.values())
        total += sum(matching(samples) for retired in self._retired.values() for samples in retired.values())
        for families in self._live.values():
            total += sum(
                s.value
                for family in families
                for s in family.samples
                if s.name == sample_name and s.labels.get("model_name") == model_name
            )
        return total

    def demand_totals(self, model_name: str) -> DemandTotals:
        """The request counters the `sla` autoscaling policy forecasts from, for one model."""
        return DemandTotals(
            prompt_tokens_received=self.sample_total("splitserve_prompt_tokens_total", model_name),
            finished_requests=self.sample_total("splitserve_request_prompt_tokens_count", model_name),
            finished_prompt_tokens=self.sample_total("splitserve_request_prompt_tokens_sum", model_name),
            finished_output_tokens=self.sample_total("splitserve_request_generation_tokens_sum", model_name),
        )

    def render(
        self,
        own: CollectorRegistry | Sequence[CollectorRegistry] | None = None,
        extra: Iterable[tuple[str, list[MetricFamily]]] = (),
    ) -> bytes:
        """The merged text exposition. own: the controller's registry (one per model where a
        deployment serves several); extra: (ingress id, families) fresher than what that
        ingress last shipped (the one being scraped)."""
        owns = [] if own is None else [own] if isinstance(own, CollectorRegistry) else list(own)
        live = dict(self._live)
        for ingress_id, families in extra:
            live[ingress_id] = families
        totals: dict[str, dict[_Key, float]] = {}
        meta = dict(self._meta)

        def add(name: str, samples: dict[_Key, float]) -> None:
            target = totals.setdefault(name, {})
            for key, value in samples.items():
                target[key] = target.get(key, 0.0) + value

        for name, samples in self._base.items():
            add(name, samples)
        for retired in self._retired.values():
            for name, samples in retired.items():
                add(name, samples)
        for families in [*live.values(), *(families_of(registry) for registry in owns)]:
            for family in families:
                meta.setdefault(family.name, (family.type, family.documentation))
                add(family.name, _sum_into({}, family.samples))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(totals, meta))
        return generate_latest(registry)


def _sum_into(target: dict[_Key, float], samples) -> dict[_Key, float]:
    for s in samples:
        key = (s.name, tuple(sorted(s.labels.items())))
        target[key] = target.get(key, 0.0) + s.value
    return target


class _Families:
    """A collector yielding merged families (prometheus_client calls collect())."""

    def __init__(self, totals: dict[str, dict[_Key, float]], meta: dict[str, tuple[str, str]]):
        self.totals, self.meta = totals, meta

    def collect(self):
        for name, samples in self.totals.items():
            typ, documentation = self.meta[name]
            metric = Metric(name, documentation, typ)
            for (sample_name, labels), value in samples.items():
                metric.add_sample(sample_name, dict(labels), value)
            yield metric
