"""IngressReport: what an ingress replica tells the controller with each membership call --
the requests it has in flight per replica (drain waits on them), its recent latency samples
(the autoscaler's TTFT / ITL signals) and, about once a second, its Prometheus samples (the
controller merges every ingress's into the one /metrics view).

Versioned msgpack (splitserve.proto.messages.codec); torch-free.
"""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry

from splitserve.proto.messages.codec import MessageCodec

REPORT_VERSION = 1
_codec = MessageCodec(REPORT_VERSION)


class MetricSample(msgspec.Struct, frozen=True, array_like=True):
    name: str  # e.g. splitserve_ttft_seconds_bucket
    labels: dict[str, str]
    value: float


class MetricFamily(msgspec.Struct, frozen=True, array_like=True):
    name: str  # e.g. splitserve_ttft_seconds
    type: str  # counter | gauge | histogram | ...
    documentation: str
    samples: list[MetricSample]


class IngressReport(msgspec.Struct, forbid_unknown_fields=True):
    # replica id -> requests this ingress sent there that still need it (decode: until they
    # finish; prefill: until their first token).
    inflight: dict[str, int] = msgspec.field(default_factory=dict)
    # (age in seconds when the report was sent, latency in seconds), observed since the
    # previous report: ages, not timestamps, so no clock is shared between processes.
    ttft: list[tuple[float, float]] = msgspec.field(default_factory=list)
    itl: list[tuple[float, float]] = msgspec.field(default_factory=list)
    metrics: list[MetricFamily] | None = None  # None: unchanged since the last report that had them

    def to_bytes(self) -> bytes:
        return _codec.encode("ingress_report", self)

    @classmethod
    def from_bytes(cls, data: bytes) -> IngressReport:
        return _codec.decode("ingress_report", cls, data)


def families_of(registry: CollectorRegistry) -> list[MetricFamily]:
    """A registry's samples as plain data. `_created` samples (a process's start time per
    series) are left out: merged across processes they mean nothing."""
    out = []
    for family in registry.collect():
        samples = [
            MetricSample(s.name, dict(s.labels), float(s.value))
            for s in family.samples
            if not s.name.endswith("_created")
        ]
        out.append(MetricFamily(family.name, family.type, family.documentation, samples))
    return out


def encode_families(families: list[MetricFamily]) -> bytes:
    return _codec.encode("metric_families", _Families(families))


def decode_families(data: bytes) -> list[MetricFamily]:
    return _codec.decode("metric_families", _Families, data).families


class _Families(msgspec.Struct):
    families: list[MetricFamily]
