"""TokenMeter records a request's tokens and inter-token gaps in batches: the same samples
as one observe per token, at most FLUSH_TOKENS tokens late."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from splitserve.cluster.frontend.metrics import LATENCY_BUCKETS, Metrics
from splitserve.cluster.frontend.token_meter import FLUSH_TOKENS, TokenMeter, observe_many
from splitserve.cluster.ingress.ingress_reporter import IngressReporter
from splitserve.proto.messages.ingress_report import IngressReport


def test_observe_many_is_observe_per_value():
    # Below, on and between bounds, past the last finite one, and repeated values.
    values = [0.0, 0.005, 0.0051, 0.1, 0.1, 0.7, 80.0, 81.0, 1e9, 0.02]
    registry = CollectorRegistry()
    one = Histogram("one", "d", ["m"], registry=registry, buckets=LATENCY_BUCKETS).labels("x")
    many = Histogram("many", "d", ["m"], registry=registry, buckets=LATENCY_BUCKETS).labels("x")
    for v in values:
        one.observe(v)
    observe_many(many, values[:4])
    observe_many(many, values[4:])
    for suffix in ("_count",) + tuple(f"_bucket:{b}" for b in (*LATENCY_BUCKETS, "+Inf")):
        name, _, bound = suffix.partition(":")
        labels = {"m": "x", **({"le": str(bound)} if bound else {})}
        expected = registry.get_sample_value(f"one{name}", labels)
        assert expected is not None and registry.get_sample_value(f"many{name}", labels) == expected, suffix
    assert registry.get_sample_value("many_count", {"m": "x"}) == len(values)
    assert registry.get_sample_value("many_sum", {"m": "x"}) == pytest.approx(sum(values))
    assert registry.get_sample_value("many_bucket", {"m": "x", "le": "0.1"}) == 6  # 0.1 counts as <= 0.1


def samples(metrics: Metrics) -> tuple[float, float, float]:
    registry = metrics.registry
    model = {"model_name": metrics.model_name}
    return (
        registry.get_sample_value("splitserve_generation_tokens_total", model),
        registry.get_sample_value("splitserve_itl_seconds_count", model),
        registry.get_sample_value("splitserve_itl_seconds_sum", model),
    )


def test_meter_flushes_every_flush_tokens_and_on_demand():
    metrics = Metrics("m")
    meter = TokenMeter(metrics)
    meter.add(1, None)  # the first chunk: a token, no gap (its latency is the TTFT)
    for _ in range(FLUSH_TOKENS - 2):
        meter.add(1, 0.5)
    assert samples(metrics) == (0.0, 0.0, 0.0)  # nothing yet: below the batch size
    meter.add(2, 0.25)  # one chunk of two tokens: two gaps of 0.25 s
    assert samples(metrics) == (FLUSH_TOKENS + 1, FLUSH_TOKENS, (FLUSH_TOKENS - 2) * 0.5 + 0.5)
    meter.add(3, 1.0)
    meter.add(0, None)
    meter.flush()
    meter.flush()  # nothing left: no double count
    assert samples(metrics) == (FLUSH_TOKENS + 4, FLUSH_TOKENS + 3, (FLUSH_TOKENS - 2) * 0.5 + 3.5)


def test_meter_hands_the_reporter_one_gap_per_chunk_in_its_batches():
    """The controller's ITL samples: one per chunk after the first (a chunk of several tokens
    is one gap, as the client saw it), handed to the IngressReporter when the meter flushes."""
    reporter = IngressReporter()
    meter = TokenMeter(Metrics("m"), reporter)

    def reported_itl() -> list[float]:
        return [gap for _, gap in IngressReport.from_bytes(reporter.report({})).itl]

    meter.add(1, None)
    for _ in range(FLUSH_TOKENS - 3):
        meter.add(1, 0.5)
    assert reported_itl() == []  # below the batch size: held
    meter.add(2, 0.25)  # reaches FLUSH_TOKENS: the batch goes out
    assert reported_itl() == [0.5] * (FLUSH_TOKENS - 3) + [0.25]
    meter.add(1, 1.0)
    meter.flush()
    assert reported_itl() == [1.0]
    unreported = TokenMeter(Metrics("m"))  # batch work, not reported: no reporter
    unreported.add(1, None)
    unreported.add(FLUSH_TOKENS, 0.5)
    assert unreported.chunk_gaps == []
