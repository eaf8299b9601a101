"""Autoscaling policy decisions per phase, pure (no Ray): prefill on queued tokens and TTFT,
decode on running requests, KV usage and ITL, with delays, cooldowns, clamps and stale
metrics; the latency window. On local Ray: test_autoscaling.py."""

from __future__ import annotations

import pytest

from splitserve.cluster.config import DecodeAutoscalingConfig, PrefillAutoscalingConfig
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.scaling.latency_window import LatencyWindow
from splitserve.cluster.scaling.policy import (
    DecodeScalingPolicy,
    MetricsSnapshot,
    PrefillScalingPolicy,
    initial_replicas,
)

# ---- policy unit tests (no Ray) ------------------------------------------------------------

PREFILL_CFG = PrefillAutoscalingConfig(
    enabled=True,
    min_replicas=1,
    max_replicas=3,
    step=1,
    upscale_delay_s=2,
    downscale_delay_s=5,
    metrics_stale_s=3,
    target_queued_tokens_per_replica=100,
    ttft_target_ms=500,
)
DECODE_CFG = DecodeAutoscalingConfig(
    enabled=True,
    min_replicas=1,
    max_replicas=4,
    step=2,
    upscale_delay_s=2,
    downscale_delay_s=5,
    metrics_stale_s=3,
    target_kv_usage=0.8,
    target_running_per_replica=8,
    itl_target_ms=50,
)


def prefill_snap(t, n, queued_each=0, ttft=None) -> MetricsSnapshot:
    return MetricsSnapshot(t, n, [LoadReport(queued_prefill_tokens=queued_each)] * n, ttft_p90_ms=ttft)


def decode_snap(t, n, running_each=0, kv=0.0, itl=None) -> MetricsSnapshot:
    return MetricsSnapshot(t, n, [LoadReport(num_running=running_each, kv_usage=kv)] * n, itl_p90_ms=itl)


def run_policy(policy, snaps_at):
    """[(now, snapshot)] -> [action] in order."""
    return [policy.decide(snap, now).action for now, snap in snaps_at]


def test_prefill_scales_up_on_queued_tokens_after_delay_then_cools_down():
    p = PrefillScalingPolicy(PREFILL_CFG)
    actions = run_policy(p, [(t, prefill_snap(t, 1, queued_each=150)) for t in (0, 1, 1.9)])
    assert actions == ["hold", "hold", "hold"]  # over, but not for upscale_delay_s yet
    d = p.decide(prefill_snap(2.0, 1, queued_each=150), 2.0)
    assert (d.action, d.target_replicas) == ("up", 2) and "queued_tokens_per_replica" in d.reason
    # cooldown: still over target, but holds for upscale_delay_s and gathers no evidence
    d = p.decide(prefill_snap(3.0, 2, queued_each=150), 3.0)
    assert d.action == "hold" and "cooldown" in d.reason
    assert run_policy(p, [(t, prefill_snap(t, 2, queued_each=150)) for t in (4.0, 5.0)]) == ["hold", "hold"]
    assert p.decide(prefill_snap(6.0, 2, queued_each=150), 6.0).target_replicas == 3
    # at max: over target is a hold
    p.mark_scaled(6.0)
    d = p.decide(prefill_snap(20.0, 3, queued_each=999), 20.0)
    assert d.action == "hold" and "max_replicas" in d.reason


def test_prefill_scales_up_on_ttft_and_an_interruption_restarts_the_delay():
    p = PrefillScalingPolicy(PREFILL_CFG)
    assert run_policy(
        p,
        [
            (0, prefill_snap(0, 1, ttft=900)),
            (1.5, prefill_snap(1.5, 1, ttft=100)),
            (2.5, prefill_snap(2.5, 1, ttft=900)),
            (4.0, prefill_snap(4.0, 1, ttft=900)),
        ],
    ) == ["hold", "hold", "hold", "hold"]
    assert p.decide(prefill_snap(4.5, 1, ttft=900), 4.5).action == "up"


def test_prefill_scales_down_only_when_well_under_for_the_delay():
    p = PrefillScalingPolicy(PREFILL_CFG)
    # 60 queued tokens: under the target of 100 but not under half of it -> never down
    assert set(run_policy(p, [(t, prefill_snap(t, 2, queued_each=60)) for t in range(0, 12)])) == {"hold"}
    p = PrefillScalingPolicy(PREFILL_CFG)
    assert run_policy(p, [(t, prefill_snap(t, 2, queued_each=10, ttft=200)) for t in (0, 4.9)]) == ["hold", "hold"]
    d = p.decide(prefill_snap(5.0, 2, queued_each=10, ttft=200), 5.0)
    assert (d.action, d.target_replicas) == ("down", 1)
    # at min_replicas: never below
    p.mark_scaled(5.0)
    assert set(run_policy(p, [(t, prefill_snap(t, 1)) for t in range(6, 30)])) == {"hold"}


def test_prefill_latency_over_target_blocks_scale_down():
    p = PrefillScalingPolicy(PREFILL_CFG.model_copy(update={"max_replicas": 2}))
    # at max, TTFT over target: no evidence for "down" however long it lasts
    assert set(run_policy(p, [(t, prefill_snap(t, 2, ttft=800)) for t in range(0, 20)])) == {"hold"}


def test_prefill_holds_on_stale_metrics_and_restarts_evidence():
    p = PrefillScalingPolicy(PREFILL_CFG)
    assert p.decide(prefill_snap(0, 1, queued_each=500), 0).action == "hold"
    d = p.decide(prefill_snap(0, 1, queued_each=500), 3.5)  # 3.5 s old > metrics_stale_s 3
    assert d.action == "hold" and "stale" in d.reason
    assert p.decide(prefill_snap(4, 1, queued_each=500), 4).action == "hold"  # evidence restarted
    assert p.decide(prefill_snap(6, 1, queued_each=500), 6).action == "up"


def test_min_max_clamps_act_at_once():
    p = PrefillScalingPolicy(PREFILL_CFG.model_copy(update={"min_replicas": 2}))
    d = p.decide(prefill_snap(0, 0), 0)
    assert (d.action, d.target_replicas) == ("up", 2)
    d = DecodeScalingPolicy(DECODE_CFG).decide(decode_snap(0, 6), 0)
    assert (d.action, d.target_replicas) == ("down", 4)
    assert initial_replicas(1, PREFILL_CFG.model_copy(update={"min_replicas": 2})) == 2
    assert initial_replicas(9, PREFILL_CFG) == 3
    assert initial_replicas(0, PrefillAutoscalingConfig()) == 0  # disabled: as configured


@pytest.mark.parametrize(
    "snap_kwargs, signal",
    [({"kv": 0.9}, "kv_usage"), ({"running_each": 9}, "running_per_replica"), ({"itl": 80.0}, "itl_p90_ms")],
)
def test_decode_scales_up_on_each_signal_by_step_within_max(snap_kwargs, signal):
    p = DecodeScalingPolicy(DECODE_CFG)
    assert p.decide(decode_snap(0, 3, **snap_kwargs), 0).action == "hold"
    d = p.decide(decode_snap(2, 3, **snap_kwargs), 2)
    assert (d.action, d.target_replicas) == ("up", 4)  # step 2, clamped to max 4
    assert signal in d.reason


def test_decode_scales_down_by_step_within_min_and_cools_down():
    p = DecodeScalingPolicy(DECODE_CFG.model_copy(update={"min_replicas": 2}))

    def quiet(t, n):  # every signal below half its target
        return decode_snap(t, n, running_each=3, kv=0.3, itl=20.0)

    assert p.decide(quiet(0, 4), 0).action == "hold"
    d = p.decide(quiet(5, 4), 5)
    assert (d.action, d.target_replicas) == ("down", 2)
    assert p.decide(quiet(6, 3), 6).reason.startswith("cooldown")
    # running 5 per replica is under target 8 but not under half: hold
    assert set(run_policy(p, [(t, decode_snap(t, 3, running_each=5)) for t in range(8, 20)])) == {"hold"}
    d = p.decide(quiet(40, 3), 40)
    assert d.action == "hold"
    d = p.decide(quiet(45, 3), 45)
    assert (d.action, d.target_replicas) == ("down", 2)  # never below min_replicas 2


def test_decode_idle_with_no_latency_samples_scales_down():
    p = DecodeScalingPolicy(DECODE_CFG)
    assert run_policy(p, [(0, decode_snap(0, 2)), (5, decode_snap(5, 2))]) == ["hold", "down"]


def test_policy_rejects_the_other_pools_config():
    with pytest.raises(TypeError):
        PrefillScalingPolicy(DECODE_CFG)
    with pytest.raises(ValueError):
        LoadReport(kv_usage=1.5)


def test_latency_window_percentile_respects_window_and_since():
    w = LatencyWindow(window_s=10)
    for i in range(1, 11):
        w.observe(i / 1000, now=float(i))  # 1..10 ms at t=1..10
    assert w.percentile_ms(90, now=10.0) == pytest.approx(9.0)
    assert w.percentile_ms(50, since=8.0, now=10.0) == pytest.approx(9.0)  # 8, 9, 10
    assert w.percentile_ms(90, now=25.0) is None  # all expired
    assert len(w) == 0
