"""The queue model on cases with known answers: one request alone (the profile's step times
exactly), M/M/1 (a single prefill server with exponential prompt lengths), the decode batch's
effect on ITL, monotonicity in replicas and load, and saturation (unmeetable, infinite)."""

from __future__ import annotations

import math
import random

import pytest

from splitserve.cluster.planning.queue_model import Deployment, Slo, percentile, predict, weighted_percentile
from splitserve.cluster.planning.workload import LengthDistribution, PlannedRequest, Workload
from splitserve.engine.simulated.step_time_profile import KVLinkProfile, StepTimeProfile

H200 = StepTimeProfile.load("llama-8b-h200")
SLO = Slo(ttft_s=1.0, itl_s=0.05)


def one_request(input_tokens: int, output_tokens: int) -> Workload:
    return Workload((PlannedRequest(0.0, input_tokens, output_tokens),), "one request")


def test_one_request_alone_takes_the_profiles_step_times():
    [alone] = predict(H200, one_request(100, 5), Deployment(0, 1), SLO).outcomes
    assert alone.ttft_s == pytest.approx(H200.prefill_s(100))
    decode_steps = [H200.decode_s(1, 100 + k) for k in range(1, 5)]  # 4 more tokens, context 101..104
    assert alone.finish_s == pytest.approx(H200.prefill_s(100) + sum(decode_steps))
    assert alone.gaps == 4


def test_a_long_prompt_is_chunked_by_the_token_budget():
    [chunked] = predict(H200, one_request(5000, 1), Deployment(0, 1, max_num_batched_tokens=2048), SLO).outcomes
    expected = H200.step_s(2048, 2048) + H200.step_s(2048, 4096) + H200.step_s(904, 5000)
    assert chunked.ttft_s == pytest.approx(expected)


def test_disaggregated_ttft_adds_the_kv_transfer_behind_the_prefill():
    slow_link = H200.model_copy(update={"kv_link": KVLinkProfile(bytes_per_s=1e9, latency_s=0.001)})
    kv_bytes = 131072
    for layerwise in (True, False):
        [moved] = predict(slow_link, one_request(1000, 3), Deployment(1, 1), SLO, kv_bytes, layerwise).outcomes
        transfer = slow_link.transfer_s(1000 * kv_bytes)  # 131 ms: longer than the 33 ms prefill
        prefill = slow_link.prefill_s(1000)
        assert moved.ttft_s == pytest.approx(max(prefill + 0.001, transfer) if layerwise else prefill + transfer)


def mm1_workload(rate: float, mean_tokens: float, num_requests: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    t, requests = 0.0, []
    for _ in range(num_requests):
        requests.append(PlannedRequest(t, max(1, math.ceil(rng.expovariate(1 / mean_tokens))), 1))
        t += rng.expovariate(rate)
    return Workload(tuple(requests), "M/M/1")


def test_a_single_prefill_server_is_mm1():
    """No overhead, no weight floor, 1 ms per token, prompts ~ Exp(200 tokens): service ~ Exp(mu = 5/s).
    At rho = 0.5 the sojourn time is Exp(mu - lambda): mean 0.4 s, p90 ln(10) x 0.4 s."""
    server = StepTimeProfile(name="mm1", step_overhead_s=0, token_compute_s=0.001, kv_link=KVLinkProfile(bytes_per_s=1))
    lam, mu = 2.5, 5.0
    prediction = predict(server, mm1_workload(lam, 200, 8000), Deployment(0, 1, 16, 1), Slo(10, 1, 90))
    sojourn = [o.ttft_s for o in prediction.outcomes]
    assert sum(sojourn) / len(sojourn) == pytest.approx(1 / (mu - lam), rel=0.1)
    assert prediction.ttft_s == pytest.approx(math.log(10) / (mu - lam), rel=0.1)
    light = predict(server, mm1_workload(0.5, 200, 4000), Deployment(0, 1, 16, 1), Slo(10, 1, 50))
    assert light.ttft_s == pytest.approx(math.log(2) / (mu - 0.5), rel=0.1)  # the median of Exp(mu - lambda)


def test_saturation_is_unmeetable_and_infinite():
    server = StepTimeProfile(name="mm1", step_overhead_s=0, token_compute_s=0.001, kv_link=KVLinkProfile(bytes_per_s=1))
    over = predict(server, mm1_workload(6.0, 200, 2000), Deployment(0, 1, 16, 1), Slo(10, 1))
    assert over.saturated == "colocated" and over.ttft_s == math.inf and not over.meets(Slo(10, 1))
    short = predict(server, mm1_workload(6.0, 200, 500), Deployment(0, 1, 16, 1), Slo(10, 1))
    longer = predict(server, mm1_workload(6.0, 200, 2000), Deployment(0, 1, 16, 1), Slo(10, 1))
    # the queue grows without bound: the later requests wait longer the longer the load lasts
    assert max(o.ttft_s for o in longer.outcomes) > 2 * max(o.ttft_s for o in short.outcomes)


def steady(rate: float, num_requests: int = 600) -> Workload:
    return Workload.poisson(rate, LengthDistribution(2048, 512), LengthDistribution(256, 128), num_requests, seed=1)


def test_the_decode_batch_sets_the_itl():
    """More load, larger decode batches, longer steps: ITL rises with the rate, and sits between a
    lone sequence's step and a full batch's."""
    itl = [predict(H200, steady(rate), Deployment(2, 1), SLO, 131072).itl_s for rate in (2, 8, 16)]
    assert itl[0] < itl[1] < itl[2]
    assert H200.decode_s(1, 2048) <= itl[0] and itl[2] <= H200.decode_s(64, 64 * 2600)


def test_more_replicas_never_make_latency_worse_and_more_load_never_better():
    load = steady(10)
    ttft = [predict(H200, load, Deployment(p, 2), SLO, 131072).ttft_s for p in (1, 2, 3)]
    assert ttft[0] >= ttft[1] >= ttft[2]
    itl = [predict(H200, load, Deployment(2, d), SLO, 131072).itl_s for d in (1, 2, 3)]
    assert itl[0] >= itl[1] >= itl[2]
    colocated = [predict(H200, steady(rate), Deployment(0, 2), SLO).ttft_s for rate in (2, 5, 8)]
    assert colocated[0] <= colocated[1] <= colocated[2]


def test_max_num_seqs_queues_requests_for_a_decode_slot():
    burst = Workload(tuple(PlannedRequest(0.0, 64, 11) for _ in range(4)), "four at once")
    one_slot = predict(H200, burst, Deployment(0, 1, max_num_seqs=1), SLO).outcomes
    assert sorted(o.finish_s for o in one_slot) == pytest.approx([o.finish_s for o in one_slot])
    assert one_slot[1].first_token_s >= one_slot[0].finish_s  # admitted only once the first one ended


def test_goodput_counts_requests_meeting_both_targets():
    load = steady(8)
    strict, loose = Slo(0.0001, 0.05), Slo(60, 60)
    assert predict(H200, load, Deployment(2, 2), strict, 131072).goodput == 0.0
    assert predict(H200, load, Deployment(2, 2), loose, 131072).goodput == 1.0


def test_percentiles():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert weighted_percentile([(1.0, 9), (5.0, 1)], 90) == 1.0
    assert weighted_percentile([(1.0, 8), (5.0, 2)], 90) == 5.0
