"""/metrics across ingress replicas: the controller merges every ingress's samples with its
own pool series. Counters and histograms add up, totals never go down when an ingress goes
away (or only seemed to), a removed replica's series are gone, and promtool finds nothing
to complain about."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.control.metrics_aggregator import MetricsAggregator
from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.cluster.frontend.metrics import Metrics, RouterViewCollector
from splitserve.proto.messages.codec import MessageError
from splitserve.proto.messages.ingress_report import IngressReport, decode_families, encode_families, families_of
from splitserve.proto.messages.membership import MembershipView, ReplicaInfo
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from tests.helpers.engine_stats import STATS


def samples(text: bytes) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def ingress(ok: int, failed: int, ttfts: list[float], inflight: int) -> Metrics:
    m = Metrics("tiny")
    m.requests.labels("ok").inc(ok)
    m.requests.labels("overloaded").inc(failed)
    for t in ttfts:
        m.ttft.observe(t)
    m.frontend_inflight.set(inflight)
    m.generation_tokens.inc(10 * ok)
    return m


def pool_metrics() -> PoolMetrics:
    pool = PoolMetrics("tiny")
    poll = PollReply([], STATS, 0, 1, TransferTotals(num_blocks=2, num_bytes=4096, seconds=0.01))
    for p, rid in (("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")):
        pool.observe_poll(p, rid, poll)
    pool.set_pool_totals("decode", 2, 0, 2)
    pool.scaling_decisions.labels("decode", "hold").inc(3)
    return pool


def key(name: str, **labels: str) -> tuple:
    """A sample's key as samples() builds it; every family is labelled model_name."""
    return (name, tuple(sorted({"model_name": "tiny", **labels}.items())))


OK = key("splitserve_requests_total", status="ok")
TTFT_COUNT = key("splitserve_ttft_seconds_count")
TTFT_LE_01 = key("splitserve_ttft_seconds_bucket", le="0.1")
INFLIGHT = key("splitserve_frontend_inflight_requests")


def test_counters_histograms_and_gauges_add_up_over_ingresses():
    a, b = ingress(3, 1, [0.05, 0.2], 2), ingress(5, 0, [0.01], 1)
    agg = MetricsAggregator()
    agg.update("a", families_of(a.registry))
    agg.update("b", decode_families(encode_families(families_of(b.registry))))  # as shipped
    merged = samples(agg.render(pool_metrics().registry))
    assert merged[OK] == 8 and merged[key("splitserve_requests_total", status="overloaded")] == 1
    assert merged[TTFT_COUNT] == 3 and merged[TTFT_LE_01] == 2
    assert merged[key("splitserve_ttft_seconds_sum")] == pytest.approx(0.26)
    assert merged[INFLIGHT] == 3
    assert merged[key("splitserve_generation_tokens_total")] == 80
    # The controller's own series, once (not once per ingress):
    assert merged[key("splitserve_replicas", pool="decode")] == 2
    assert merged[key("splitserve_kv_transfer_bytes_total")] == 2 * 4096  # two decode replicas
    assert merged[key("splitserve_scaling_decisions_total", decision="hold", pool="decode")] == 3
    assert not [k for k in merged if k[0].endswith("_created")]


def test_totals_stay_monotonic_when_an_ingress_goes_and_when_it_comes_back():
    a, b = ingress(3, 0, [0.05], 4), ingress(5, 0, [0.01], 1)
    agg = MetricsAggregator()
    agg.update("a", families_of(a.registry))
    agg.update("b", families_of(b.registry))
    before = samples(agg.render())
    agg.retire("a")  # killed: its last samples stay counted, its gauge goes
    after = samples(agg.render())
    assert after[OK] == before[OK] == 8 and after[TTFT_COUNT] == before[TTFT_COUNT] == 2
    assert after[INFLIGHT] == 1
    b.requests.labels("ok").inc(2)
    agg.update("b", families_of(b.registry))
    assert samples(agg.render())[OK] == 10
    # "a" was only slow, not gone: it reports again and is counted once, not twice
    a.requests.labels("ok").inc()
    agg.update("a", families_of(a.registry))
    assert samples(agg.render())[OK] == 11
    # a fresher sample set from the ingress being scraped wins over what it last shipped
    a.requests.labels("ok").inc()
    assert samples(agg.render(extra=[("a", families_of(a.registry))]))[OK] == 12


def test_each_ingress_router_view_is_its_own_series_and_goes_with_it():
    views = {"a": {"prefill": 12, "decode": 3}, "b": {"prefill": 9, "decode": 3}}
    agg = MetricsAggregator()
    for name, view in views.items():
        m = Metrics("tiny")
        m.registry.register(RouterViewCollector("tiny", name, lambda view=view: dict(view)))
        agg.update(name, families_of(m.registry))
    merged = samples(agg.render())
    indexed = {k: v for k, v in merged.items() if k[0] == "splitserve_router_indexed_blocks"}
    assert indexed == {
        key("splitserve_router_indexed_blocks", pool=pool, ingress=name): n
        for name, view in views.items()
        for pool, n in view.items()
    }
    agg.retire("b")  # a gauge: the retired ingress's series goes, it is not summed into "a"
    assert {k for k in samples(agg.render()) if k[0] == "splitserve_router_indexed_blocks"} == {
        key("splitserve_router_indexed_blocks", pool=pool, ingress="a") for pool in ("prefill", "decode")
    }


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_merged_exposition_passes_promtool():
    agg = MetricsAggregator()
    agg.update("a", families_of(ingress(3, 1, [0.05, 0.2], 2).registry))
    agg.update("b", families_of(ingress(1, 0, [0.5], 0).registry))
    agg.retire("b")
    text = agg.render(pool_metrics().registry)
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (res.stdout, res.stderr)


def test_membership_and_report_messages_round_trip_and_refuse_foreign_bytes():
    view = MembershipView(
        version=7,
        replicas=[
            ReplicaInfo("decode", "decode-0", "splitserve-x", ("10.0.0.2", 4123), actor_id="ab"),
            ReplicaInfo("prefill", "prefill-1", "splitserve-x", draining=True),
        ],
        expected={"prefill": 1, "decode": 1},
    )
    again = MembershipView.from_bytes(view.to_bytes())
    assert again == view and again.serving("prefill") == [] and again.replicas[0].channel_address == ("10.0.0.2", 4123)
    report = IngressReport(inflight={"decode-0": 2}, ttft=[(0.1, 0.02)], metrics=families_of(Metrics("tiny").registry))
    assert IngressReport.from_bytes(report.to_bytes()) == report
    with pytest.raises(MessageError, match="expected a membership_view"):
        MembershipView.from_bytes(report.to_bytes())
    with pytest.raises(MessageError):
        IngressReport.from_bytes(b"\x93garbage")
