"""predict steps a replica on by itself while no queued event comes first; this pins that it
gives exactly the Prediction (the same floats, every outcome) of the plain event loop, which
sends every step through the heap, on colocated, disaggregated, TP and saturated workloads."""

from __future__ import annotations

import heapq
import itertools

import pytest

from splitserve.cluster.planning.queue_model import (
    Deployment,
    Slo,
    percentile,
    predict,
    saturated_pool,
    weighted_percentile,
)
from splitserve.cluster.planning.replica_model import PlannedOutcome, ReplicaModel
from splitserve.cluster.planning.workload import LengthDistribution, Workload
from splitserve.engine.simulated.step_time_profile import StepTimeProfile

H200 = StepTimeProfile.load("llama-8b-h200")
SLO = Slo(ttft_s=1.0, itl_s=0.05)
KV_BYTES = 131072


def reference_predict(profile, workload, deployment, slo, kv_bytes_per_token=0, layerwise_transfer=True):
    """The queue model's event loop without shortcuts: one heap entry per step."""
    budget, seqs, itl = deployment.max_num_batched_tokens, deployment.max_num_seqs, slo.itl_s
    decode_profile = profile.for_tensor_parallel(deployment.decode_tp)
    prefill_profile = profile.for_tensor_parallel(deployment.prefill_tp) if not deployment.colocated else profile
    decode = [ReplicaModel(decode_profile, budget, seqs, itl) for _ in range(deployment.decode_replicas)]
    prefill = [ReplicaModel(prefill_profile, budget, seqs, itl, True) for _ in range(deployment.prefill_replicas)]
    link_free = [0.0] * len(prefill)
    decode_of, events, order = {}, [], itertools.count()
    outcomes = [PlannedOutcome(r.arrival_s, r.input_tokens, r.output_tokens) for r in workload.requests]
    for outcome in outcomes:
        heapq.heappush(events, (outcome.arrival_s, next(order), "arrival", outcome))

    def give(replica, outcome, now):
        replica.add(outcome)
        if replica.busy_until is None:
            heapq.heappush(events, (replica.start_step(now), next(order), "step", replica))

    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "arrival":
            target = min(decode, key=lambda r: r.assigned)
            target.assigned += 1
            if deployment.colocated:
                give(target, item, now)
            else:
                decode_of[id(item)] = target
                give(min(prefill, key=lambda r: r.queued_prompt_tokens), item, now)
        elif kind == "handoff":
            item.first_token_s = now
            give(decode_of.pop(id(item)), item, now)
        else:
            prefilled, _ = item.finish_step()
            if item.prefill_only:
                link = prefill.index(item)
                for outcome in prefilled:
                    if outcome.output_tokens == 1:
                        outcome.finish_s = now
                        decode_of.pop(id(outcome)).assigned -= 1
                        continue
                    transfer = profile.transfer_s(outcome.input_tokens * kv_bytes_per_token)
                    if layerwise_transfer:
                        done = max(now + profile.kv_link.latency_s * bool(transfer), link_free[link] + transfer)
                    else:
                        done = max(now, link_free[link]) + transfer
                    link_free[link] = done
                    heapq.heappush(events, (done, next(order), "handoff", outcome))
            if item.has_work:
                heapq.heappush(events, (item.start_step(now), next(order), "step", item))

    saturated = saturated_pool(profile, workload, deployment)
    steps = [pair for replica in decode for pair in replica.step_log]
    good = sum(o.ttft_s <= slo.ttft_s and o.slow_gaps <= slo.max_slow_gaps(o.gaps) for o in outcomes)
    return (
        float("inf") if saturated else percentile([o.ttft_s for o in outcomes], slo.percentile),
        float("inf") if saturated in ("decode", "colocated") else weighted_percentile(steps, slo.percentile),
        0.0 if saturated else good / len(outcomes),
        saturated,
        outcomes,
    )


def workload(rate: float, num_requests: int, output_mean: int = 256) -> Workload:
    lengths = LengthDistribution(2048, 512), LengthDistribution(output_mean, output_mean // 2)
    return Workload.poisson(rate, *lengths, num_requests, seed=7)


CASES = {
    "colocated": (workload(4, 200), Deployment(0, 2)),
    "colocated, few seats": (workload(8, 150), Deployment(0, 1, max_num_seqs=4)),
    "disaggregated": (workload(10, 250), Deployment(2, 2)),
    "disaggregated, small budget": (workload(6, 150), Deployment(1, 2, max_num_batched_tokens=512)),
    "tensor parallel": (workload(10, 200), Deployment(1, 1, prefill_tp=2, decode_tp=2)),
    "saturated": (workload(60, 200, 64), Deployment(1, 1)),
    "single-token answers": (workload(20, 150, 2), Deployment(1, 1)),
}


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_predict_equals_the_plain_event_loop(case, layerwise):
    load, deployment = CASES[case]
    fast = predict(H200, load, deployment, SLO, KV_BYTES, layerwise)
    ttft, itl, goodput, saturated, outcomes = reference_predict(H200, load, deployment, SLO, KV_BYTES, layerwise)
    assert (fast.ttft_s, fast.itl_s, fast.goodput, fast.saturated) == (ttft, itl, goodput, saturated)
    assert fast.outcomes == outcomes
