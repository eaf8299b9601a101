"""bench/serving/migration_report.py on a hand-made run: what counts as a completed stream,
which phase a TTFT and a gap belong to, the p99 ratio, a replacement's time, the moved
streams' client-side gap, and the table. (The run itself needs Ray: `--quick` runs it small.)"""

from __future__ import annotations

from argparse import Namespace

import pytest

from splitserve.bench.serving.migration_report import Stream, markdown, summarize

ARGS = Namespace(baseline_s=10.0, max_tokens=3, decode_replicas=2)


def stream(label: str, sent: float, times: list[float], **fields) -> dict:
    chunks = [(t, 1) for t in times]
    done = {"status": 200, "finish": "length", "usage_tokens": len(times)}
    return Stream(label, [1, 2], sent_s=sent, chunks=chunks, **{**done, **fields}).to_dict()


def run() -> dict:
    return {
        "name": "x",
        "host_tier_gib": 0.0,
        "start_s": 1.0,
        "capacity_tokens_per_s": 100.0,
        "rate_rps": 2.0,
        "streams": [
            stream("a", 1.0, [1.1, 1.2, 1.3]),  # baseline: TTFT 0.1 s, gaps 0.1 s
            stream("b", 11.0, [11.4, 11.5, 12.5]),  # failures: TTFT 0.4 s, gaps 0.1 and 1.0 s (moved)
            stream("c", 12.0, [12.1, 12.2]),  # a token missing: not completed
            stream("d", 12.0, [12.1], error="stream_error: gone"),
        ],
        "kills": [{"at_s": 12.0, "victim": "decode-0", "streams": 1}],
        "pool_samples": [(11.0, ["decode-0", "decode-1"]), (12.5, ["decode-1"]), (14.0, ["decode-1", "decode-2"])],
        "moves": [("channel_closed", 2)],
        "refusals": [],
        "gap_s": [0.9],
        "recomputed_tokens": [4],
        "moved_labels": ["b"],
        "move_log": [("b", 12.3)],
        "baseline": {
            "ok": True,
            "after_s": 2.0,
            "busy": [],
            "stale_routed": [],
            "live_decode": 2,
            "host_stored_loaded_blocks": {},
        },
        "verify": {"moved": {"checked": 1, "equal": 1}, "unmoved": {"checked": 0, "equal": 0}},
    }


def test_a_completed_stream_has_every_token_and_no_error():
    assert Stream("s", [], status=200, finish="length", usage_tokens=2, chunks=[(0.1, 1), (0.2, 1)]).completed(2)
    assert not Stream("s", [], status=200, finish="length", usage_tokens=2, chunks=[(0.1, 2)]).completed(3)
    assert not Stream("s", [], status=200, finish="length", usage_tokens=1, chunks=[(0.1, 2)]).completed(2)
    assert not Stream("s", [], status=200, finish=None, usage_tokens=2, chunks=[(0.1, 2)]).completed(2)


def test_summary_splits_the_phases_and_times_the_moves():
    summary = summarize(run(), ARGS)
    assert (summary["streams"], summary["completed"]) == (4, 2)
    assert summary["errors"] == {"finish=length tokens=2": 1, "stream_error": 1}
    assert summary["phases"]["baseline"]["ttft_ms"]["p99"] == pytest.approx(100.0)
    assert summary["phases"]["failures"]["ttft_ms"]["p99"] == pytest.approx(400.0)
    assert summary["phases"]["failures"]["itl_ms"]["p50"] == pytest.approx(550.0)
    assert summary["p99_ratio_failures_to_baseline"]["ttft_ms"] == pytest.approx(4.0)
    assert summary["client_gap_s"]["p50"] == pytest.approx(1.0)
    assert summary["replaced_after_s"] == [2.0]  # the victim gone at 12.5, the pool full at 14.0
    assert (summary["moves"], summary["recomputed_tokens"]["mean"]) == (1, 4.0)
    assert summary["kill_to_move_s"]["p50"] == pytest.approx(0.3)  # killed at 12.0, moved at 12.3
    assert summary["move_to_next_token_s"]["p50"] == pytest.approx(0.2)  # its next token at 12.5


def test_the_table_has_a_column_per_configuration():
    table = markdown([summarize(run(), ARGS), summarize(run(), ARGS)])
    assert table.splitlines()[0] == "| | x | x |"
    assert "| streams completed | 2 / 4 (50.0%) | 2 / 4 (50.0%) |" in table
