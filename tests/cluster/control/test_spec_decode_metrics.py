"""Speculative-decoding families folded from replica polls: counters per pool and method,
the chosen-k histogram, the acceptance-rate and mean-accepted-length gauges."""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from tests.helpers.engine_stats import STATS_FIELDS as BASE


def poll(drafts: int, proposed: int, accepted: int, hist: list[int], method: str = "ngram") -> PollReply:
    stats = EngineStats(
        **BASE,
        spec_method=method,
        spec_num_drafts=drafts,
        spec_proposed_tokens=proposed,
        spec_accepted_tokens=accepted,
        spec_emitted_tokens=accepted + drafts,
        spec_k_histogram=hist,
    )
    return PollReply([], stats, 0, 1, TransferTotals(num_blocks=0, num_bytes=0, seconds=0.0))


def samples(metrics: PoolMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name.startswith("splitserve_spec_decode"):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
    return out


def test_spec_decode_families_sum_replica_increments():
    # The stats cross Ray in the poll reply: the new fields survive msgpack.
    reply = poll(2, 8, 6, [1, 0, 0, 0, 2])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=PollReply) == reply
    metrics = PoolMetrics("tiny")
    metrics.observe_poll("decode", "d0", poll(2, 8, 6, [1, 0, 0, 0, 2]))
    metrics.observe_poll("decode", "d1", poll(1, 4, 0, [3, 0, 0, 0, 1]))
    metrics.observe_poll("decode", "d0", poll(4, 16, 10, [1, 0, 0, 0, 4]))  # cumulative: +2 drafts
    got = samples(metrics)
    pool = (("method", "ngram"), ("pool", "decode"))
    assert got[("splitserve_spec_decode_num_drafts_total", pool)] == 5
    assert got[("splitserve_spec_decode_num_draft_tokens_total", pool)] == 20
    assert got[("splitserve_spec_decode_num_accepted_tokens_total", pool)] == 10
    assert got[("splitserve_spec_decode_num_emitted_tokens_total", pool)] == 15
    assert got[("splitserve_spec_decode_acceptance_rate", pool)] == 0.5
    assert got[("splitserve_spec_decode_mean_accepted_length", pool)] == 2.0
    assert got[("splitserve_spec_decode_chosen_k_total", (("k", "0"), ("pool", "decode")))] == 4
    assert got[("splitserve_spec_decode_chosen_k_total", (("k", "4"), ("pool", "decode")))] == 5
    # A replica that restarts under the same id starts from zero again.
    metrics.forget_replica("decode", "d1")
    metrics.observe_poll("decode", "d1", poll(1, 4, 4, [0, 0, 0, 0, 1]))
    assert samples(metrics)[("splitserve_spec_decode_num_drafts_total", pool)] == 6
    # Engines that do not speculate add no series.
    quiet = PoolMetrics("tiny")
    quiet.observe_poll("prefill", "p0", msgspec.structs.replace(poll(0, 0, 0, []), engine=EngineStats(**BASE)))
    assert samples(quiet) == {}
