"""The simulated engine's bench tools without a cluster: the step-profile fit recovers known
coefficients (and never goes negative), and the scale report computes per-replica scaling and
draws its plot."""

from __future__ import annotations

import random

import pytest

from splitserve.bench.control_plane.fit_step_profile import fit
from splitserve.bench.control_plane.scale_simulated_report import plot, table


def test_fit_recovers_a_known_step_model():
    rng = random.Random(0)
    samples = []
    for _ in range(200):
        new, context = rng.randrange(1, 1024), rng.randrange(1, 8192)
        seconds = 0.01 + new * 0.0005 + context * 0.000002
        samples.append((new, context, seconds * rng.uniform(0.98, 1.02)))
    overhead, per_token, per_context, error = fit(samples)
    assert overhead == pytest.approx(0.01, rel=0.1)
    assert per_token == pytest.approx(0.0005, rel=0.05)
    assert per_context == pytest.approx(0.000002, rel=0.1)
    assert error < 0.03
    # A term the data says is negative is dropped, not fitted below zero.
    _, _, per_context, _ = fit([(n, 100 * (10 - n), 0.01 + n * 0.001) for n in range(1, 10)])
    assert per_context >= 0


def row(n: int, tokens_per_s: float, mode: str = "poll") -> dict:
    return {
        "decode": n,
        "mode": mode,
        "idle_push_cpu_share": 0.001,
        "push_cpu_share_loaded": 0.004,
        "prefill": max(1, n // 4),
        "start_s": 1.0,
        "sim_tokens_per_s": tokens_per_s,
        "route_us_p50": 100.0,
        "route_us_p99": 200.0,
        "cpu_ms_per_token": 0.5,
        "idle_polls_per_s": 10.0 * n,
        "poll_bytes_per_s": 1000.0,
        "events_per_s": 1.0,
        "idle_cpu_share": 0.02,
        "idle_cpu_share_no_ingress_poll": 0.01,
        "probe_round_ms_p50": 5.0,
        "probe_round_ms_p99": 9.0,
        "view_bytes": 100 * n,
        "new_replica_routable_s": 2.0,
    }


def test_scale_report_table_and_plot(tmp_path):
    rows = [row(1, 600.0), row(1, 500.0, "push"), row(4, 2400.0), row(4, 2000.0, "push"), row(16, 7200.0)]
    rows.append({"decode": 64, "skipped": "memory"})
    lines = table(rows)
    assert "| 16 | 4 | poll | 1 | 7200 | 0.75 |" in lines[6]
    assert "| 4 | 1 | push | 1 | 2000 | 1.00 |" in lines[5] and "0.10% / 0.40%" in lines[5]  # vs push's n=1
    assert "skipped: memory" in lines[7]
    plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
