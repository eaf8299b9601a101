"""The first chunk's stages with the ingress's own (cluster/frontend/first_token_stages.py): one
dict in the path's order, which /metrics observes and a response reports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from splitserve.cluster.frontend.first_token_stages import STAGES, observe_first_token, with_ingress_stage
from splitserve.proto.messages.handoff import StreamChunk


def _chunk(**fields) -> StreamChunk:
    return StreamChunk(
        "r", [5], "a", False, None, num_prompt_tokens=3, num_cached_tokens=0, num_output_tokens=1, **fields
    )


def test_the_ingress_stage_joins_in_path_order_and_each_stage_is_observed_once():
    replica = {"relay": 0.002, "prefill_compute": 0.01, "routing": 0.001, "handoff": -0.0001}
    chunk = with_ingress_stage(_chunk(first_token_stages=replica), 0.003)
    assert list(chunk.first_token_stages) == ["ingress", "routing", "prefill_compute", "handoff", "relay"]
    assert chunk.first_token_stages == {**replica, "ingress": 0.003}
    registry = CollectorRegistry()
    observe_first_token(Histogram("stage_seconds", "", ["stage"], registry=registry), chunk)
    counts = {stage: registry.get_sample_value("stage_seconds_count", {"stage": stage}) for stage in STAGES}
    sums = {stage: registry.get_sample_value("stage_seconds_sum", {"stage": stage}) for stage in STAGES}
    assert counts == {stage: 1.0 if stage in chunk.first_token_stages else None for stage in STAGES}
    assert sums == {**dict.fromkeys(STAGES), **replica, "ingress": 0.003, "handoff": 0.0}  # clamped at 0
    # A chunk without stages (a continuation after a migration), or no arrival time: as it was.
    later = _chunk()
    assert with_ingress_stage(later, 0.003) is later and with_ingress_stage(chunk, None) is chunk
