"""Local or remote prefill by measured cost (cluster/routing/prefill_placement.py) in the router:
the cost formula on given figures, the choice both ways (idle decode replica: local; a full
one: remote), the fallback to the threshold rule while a replica is cold, the threshold as an
override, the "threshold" placement ignoring measurements, and the measured figures reaching a
LoadReport from a replica's poll reply."""

from __future__ import annotations

import msgspec
import pytest

from splitserve.cluster.routing.load import LoadReport, ReplicaLoad
from splitserve.cluster.routing.prefill_placement import (
    LOCAL_CHEAPER,
    REMOTE_CHEAPER,
    local_prefill_seconds,
    placement_cost,
    remote_prefill_seconds,
    runs_alone,
)
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from tests.helpers.engine_stats import STATS

BS = 4
PROMPT = list(range(1000, 1064))  # 64 tokens, 16 blocks
PER_TOKEN = 1e-3  # seconds per prefilled token, on either replica
DECODE_STEP = 0.010
BLOCK_BYTES = 1 << 20
THROUGHPUT = 1e9  # bytes per second sent: 16 blocks move in 16.8 ms


def measured(num_running: int = 0, queued: int = 0, **figures) -> LoadReport:
    fields = dict(
        prefill_seconds_per_token=PER_TOKEN,
        decode_step_seconds=DECODE_STEP,
        kv_block_bytes=BLOCK_BYTES,
        transfer_bytes_per_second=THROUGHPUT,
    )
    return LoadReport(queued_prefill_tokens=queued, num_running=num_running, **(fields | figures))


def router(placement: str = "measured", threshold: int = 0) -> Router:
    config = RouterConfig(policy="kv", local_prefill_threshold=threshold, prefill_placement=placement)
    r = Router(config, block_size=BS, seed=3)
    r.add_replica(PREFILL, "p0")
    r.add_replica(DECODE, "d0")
    return r


def loaded(placement: str = "measured", threshold: int = 0, decode=None, prefill=None) -> Router:
    r = router(placement, threshold)
    r.update_load(PREFILL, "p0", prefill if prefill is not None else measured())
    r.update_load(DECODE, "d0", decode if decode is not None else measured())
    return r


def test_the_costs_follow_the_formula():
    step = 0.002  # a prefilling step's fixed cost, on either replica
    decode = ReplicaLoad("d0", measured(num_running=3, queued=10, prefill_step_seconds=step))
    decode.add_pending(6)  # routed since the report: one more running, 6 more queued tokens
    prefill = ReplicaLoad("p0", measured(queued=20, prefill_step_seconds=step))
    remainder = 40
    # The prefill rides a step of decode's running batch: that step's cost, not the fixed one.
    local = (16 * PER_TOKEN) + DECODE_STEP + remainder * PER_TOKEN + 4 * remainder * PER_TOKEN
    assert local_prefill_seconds(decode, remainder) == pytest.approx(local)
    idle = ReplicaLoad("d1", measured(prefill_step_seconds=step))
    assert local_prefill_seconds(idle, remainder) == pytest.approx(step + remainder * PER_TOKEN)
    remote = step + (20 + 50) * PER_TOKEN + 10 * BLOCK_BYTES / THROUGHPUT  # 40 tokens: 10 blocks of 4
    assert remote_prefill_seconds(prefill, 50, remainder, BS) == pytest.approx(remote)
    cost = placement_cost(decode, prefill, 60, remainder, 50, BS)
    assert cost is not None and (cost.local_seconds, cost.remote_seconds) == pytest.approx((local, remote))
    assert not cost.local_wins and cost.reason == REMOTE_CHEAPER


# A fresh prompt alone in its step (on CPU the scripted prefill): 1 ms + 0.2 ms a token, a
# fifth of the other prefilling steps' (tails, mixed steps: the eager forward) per token.
FRESH = dict(fresh_prefill_step_seconds=0.001, fresh_prefill_seconds_per_token=2e-4)


def test_each_side_is_priced_on_the_line_of_the_forward_it_runs():
    step = 0.004
    idle = ReplicaLoad("d0", measured(prefill_step_seconds=step, **FRESH))
    # The whole prompt, nothing else there: its own step on the fresh line.
    assert runs_alone(idle, 64, 64)
    assert local_prefill_seconds(idle, 64, fresh=True) == pytest.approx(0.001 + 64 * 2e-4)
    # A tail after a prefix hit runs the eager forward: the other line.
    assert not runs_alone(idle, 32, 64)
    assert local_prefill_seconds(idle, 32) == pytest.approx(step + 32 * PER_TOKEN)
    # Joining a running batch or a queue is a mixed step, even for a whole prompt.
    assert not runs_alone(ReplicaLoad("d1", measured(num_running=1, **FRESH)), 64, 64)
    assert not runs_alone(ReplicaLoad("d2", measured(queued=8, **FRESH)), 64, 64)
    busy = ReplicaLoad("d3", measured(**FRESH))
    busy.add_pending(64)  # routed there since its report
    assert not runs_alone(busy, 64, 64)
    prefill = ReplicaLoad("p0", measured(prefill_step_seconds=step, **FRESH))
    transfer = 16 * BLOCK_BYTES / THROUGHPUT
    assert remote_prefill_seconds(prefill, 64, 64, BS, fresh=True) == pytest.approx(0.001 + 64 * 2e-4 + transfer)
    assert remote_prefill_seconds(prefill, 64, 64, BS) == pytest.approx(step + 64 * PER_TOKEN + transfer)
    # placement_cost decides each side's forward: decode holds 32 (a tail), the prefill replica none.
    cost = placement_cost(idle, prefill, 64, 32, 64, BS)
    assert cost is not None
    assert (cost.local_seconds, cost.remote_seconds) == pytest.approx(
        (step + 32 * PER_TOKEN, 0.001 + 64 * 2e-4 + 8 * BLOCK_BYTES / THROUGHPUT)
    )


def test_a_replica_with_one_line_measured_prices_both_kinds_on_it():
    only_fresh = ReplicaLoad("d0", measured(prefill_seconds_per_token=0.0, **FRESH))
    assert local_prefill_seconds(only_fresh, 32) == pytest.approx(0.001 + 32 * 2e-4)
    only_mixed = ReplicaLoad("d1", measured())
    assert local_prefill_seconds(only_mixed, 64, fresh=True) == pytest.approx(64 * PER_TOKEN)
    cold = ReplicaLoad("d2", measured(prefill_seconds_per_token=0.0))
    assert local_prefill_seconds(cold, 64, fresh=True) is None and local_prefill_seconds(cold, 64) is None


def test_an_idle_decode_replica_prices_a_fresh_prompt_on_its_scripted_line():
    """The same idle replicas with their fresh lines measured: the decode replica's whole prompt
    on its fresh line (13.8 ms) against the prefill replica's (13.8 ms + 16.8 ms of transfer);
    priced on the eager line alone, a full decode replica's stall would have been 5x it."""
    r = loaded(decode=measured(**FRESH), prefill=measured(**FRESH))
    assert r.route(PROMPT).reason == LOCAL_CHEAPER
    # Full: 10 ms + 8 x 64 ms of stall on the eager line, against 13.8 + 16.8 ms remote.
    r = loaded(decode=measured(num_running=8, **FRESH), prefill=measured(**FRESH))
    assert r.route(PROMPT).reason == REMOTE_CHEAPER


def test_an_idle_decode_replica_prefills_locally():
    r = loaded()
    decision = r.route(PROMPT)
    # local 64 ms against remote 64 ms + 16.8 ms of transfer
    assert decision.local_prefill and decision.reason == LOCAL_CHEAPER
    assert decision.num_transfer_tokens == 0 and decision.decode_replica == "d0"
    assert r.load(DECODE, "d0").pending_tokens == len(PROMPT)  # its own prefill queue now
    assert r.decision_counts() == {LOCAL_CHEAPER: 1}


def test_a_full_decode_replica_sends_the_prompt_to_the_prefill_replica():
    r = loaded(decode=measured(num_running=8))
    decision = r.route(PROMPT)
    # local: 10 ms step + 64 ms + 8 x 64 ms of stall, against 80.8 ms remote
    assert decision.prefill_replica == "p0" and decision.reason == REMOTE_CHEAPER
    assert decision.num_transfer_tokens == len(PROMPT)
    assert r.decision_counts() == {REMOTE_CHEAPER: 1}


def test_a_slow_transfer_keeps_even_a_busy_decode_replicas_prompt_local():
    r = loaded(decode=measured(num_running=2), prefill=measured(transfer_bytes_per_second=1e7))
    # local 10 + 3 x 64 = 202 ms; remote 64 ms + 16 MiB at 10 MB/s = 1.7 s
    assert r.route(PROMPT).reason == LOCAL_CHEAPER


def test_a_queued_prefill_replica_loses_to_an_idle_decode_replica_only_by_its_queue():
    r = loaded(decode=measured(num_running=1), prefill=measured(queued=4000))
    # local 10 + 2 x 64 = 138 ms; remote 4 s of queue first
    assert r.route(PROMPT).reason == LOCAL_CHEAPER
    r = loaded(decode=measured(num_running=1), prefill=measured(queued=0))
    assert r.route(PROMPT).reason == REMOTE_CHEAPER  # 80.8 ms against 138 ms


def test_the_measured_hop_prices_remote_prefill_unless_the_transfer_takes_longer():
    prefill = ReplicaLoad("p0", measured())
    compute = 64 * PER_TOKEN
    transfer = 16 * BLOCK_BYTES / THROUGHPUT
    assert remote_prefill_seconds(prefill, 64, 64, BS, 0.080) == pytest.approx(compute + 0.080)
    assert remote_prefill_seconds(prefill, 64, 64, BS, 0.001) == pytest.approx(compute + transfer)
    r = loaded(decode=measured(num_running=1))
    assert r.route(PROMPT).reason == REMOTE_CHEAPER  # 80.8 ms against 138 ms, no hop seen yet
    # What remote requests' first tokens reported: a pair's first (its connection set up), then
    # the usual hop; -1 is ignored. Too few samples price no hop yet; then their median does.
    for seconds in (2.0, 0.090, -1.0):
        r.observe_remote_handoff(seconds)
    assert r.remote_handoff.seconds == 0.0
    for seconds in (0.080, 0.085):
        r.observe_remote_handoff(seconds)
    assert r.remote_handoff.seconds == pytest.approx(0.0875)  # the median of 2.0, 0.09, 0.08, 0.085
    r.update_load(DECODE, "d0", measured(num_running=1))
    assert r.route(PROMPT).reason == LOCAL_CHEAPER  # remote 64 ms + 87.5 ms of hop against 138 ms


@pytest.mark.parametrize(
    "cold",
    [
        {"decode": measured(num_running=0, prefill_seconds_per_token=0.0)},  # decode never prefilled
        {"prefill": measured(prefill_seconds_per_token=0.0)},  # prefill replica never prefilled
        {"prefill": measured(transfer_bytes_per_second=0.0)},  # it sent no KV yet
        {"prefill": measured(kv_block_bytes=0)},
    ],
)
def test_a_cold_replica_falls_back_to_the_threshold_rule(cold):
    r = loaded(**cold)
    decision = r.route(PROMPT)  # an idle decode replica, yet no measured cost: remote, as today
    assert decision.prefill_replica == "p0" and decision.reason not in (LOCAL_CHEAPER, REMOTE_CHEAPER)
    assert decision.reason == router("threshold").route(PROMPT).reason


def test_the_threshold_overrides_the_measured_choice():
    r = loaded(threshold=len(PROMPT) + 1, decode=measured(num_running=8))  # full, yet below the threshold
    decision = r.route(PROMPT)
    assert decision.local_prefill and decision.reason == "local-prefill"


def test_threshold_placement_ignores_the_measurements():
    r = loaded(placement="threshold")  # an idle, measured decode replica
    decision = r.route(PROMPT)
    assert decision.prefill_replica == "p0" and decision.reason not in (LOCAL_CHEAPER, REMOTE_CHEAPER)
    assert RouterConfig().prefill_placement == "threshold"  # the default (router_config.py says why)


def test_routed_requests_count_until_the_next_report():
    r = loaded(decode=measured(num_running=0))
    assert r.route(PROMPT).reason == LOCAL_CHEAPER
    # the first one now runs there (pending): the next pays 64 ms of its queue and the stall
    second = r.route(list(range(2000, 2064)))
    assert second.reason == REMOTE_CHEAPER


def test_a_poll_reply_carries_the_measured_figures():
    stats = msgspec.structs.replace(
        STATS,
        prefill_seconds_per_token=2e-4,
        decode_step_seconds=0.02,
        kv_block_bytes=4096,
        fresh_prefill_step_seconds=0.003,
        fresh_prefill_seconds_per_token=5e-5,
    )
    poll = PollReply([], stats, 0, 0, TransferTotals(num_blocks=10, num_bytes=40960, seconds=0.5))
    report = LoadReport.from_poll(PollReply.from_bytes(poll.to_bytes()))
    assert (report.prefill_seconds_per_token, report.decode_step_seconds) == (2e-4, 0.02)
    assert report.prefill_line(fresh=True) == (0.003, 5e-5)
    assert report.kv_block_bytes == 4096 and report.transfer_bytes_per_second == pytest.approx(81920.0)
    assert LoadReport.from_poll(PollReply([], STATS, 0, 0, TransferTotals())).transfer_bytes_per_second == 0.0
    with pytest.raises(ValueError):
        LoadReport(prefill_seconds_per_token=-1.0)
