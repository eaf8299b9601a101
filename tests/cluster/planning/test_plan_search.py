"""The search: colocated wins where it is cheaper, disaggregated where it is, and nothing
meeting the SLOs is said with the closest configuration."""

from __future__ import annotations

from splitserve.cluster.planning.queue_model import Slo
from splitserve.cluster.planning.search import candidates, search
from splitserve.cluster.planning.workload import LengthDistribution, Workload
from splitserve.engine.simulated.step_time_profile import StepTimeProfile

H200 = StepTimeProfile.load("llama-8b-h200")
KV_BYTES = 131072  # Llama-3.1-8B's, the profile's
TP1 = (1,)  # one GPU per replica: the colocated / disaggregated comparisons without TP


def poisson(rate: float, input_len: str, output_len: str, num_requests: int = 400) -> Workload:
    lengths = LengthDistribution.parse(input_len, "input"), LengthDistribution.parse(output_len, "output")
    return Workload.poisson(rate, *lengths, num_requests, seed=3)


def test_candidates_cover_colocated_and_every_split():
    found = candidates(3, (512, 2048))
    assert len(found) == 2 * 3 and {(d.prefill_replicas, d.decode_replicas) for d in found} == {(0, 3), (1, 2), (2, 1)}


def test_candidates_at_each_tp_size_add_up_to_the_gpus():
    found = candidates(4, (512,), tp_sizes=(1, 2))
    shapes = {(d.prefill_replicas, d.prefill_tp, d.decode_replicas, d.decode_tp) for d in found if not d.colocated}
    assert shapes == {(1, 1, 3, 1), (2, 1, 2, 1), (3, 1, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (1, 2, 1, 2)}
    assert {(d.decode_replicas, d.decode_tp) for d in found if d.colocated} == {(4, 1), (2, 2)}
    assert all(d.gpus == 4 for d in found)


def test_tensor_parallelism_meets_a_ttft_no_single_gpu_replica_can():
    """A 2048-token prompt takes ~68 ms on one H200 (the profile's TP-1 figures): TTFT p90 <= 50
    ms is out of reach at TP 1 with any number of replicas, and within it at TP 2 (~36 ms)."""
    slo, workload = Slo(ttft_s=0.05, itl_s=0.05), poisson(2, "2048", "64", 100)
    assert search(H200, workload, slo, 4, KV_BYTES, tp_sizes=TP1).winner is None
    plan = search(H200, workload, slo, 4, KV_BYTES)  # the profile's sizes: 1, 2 and 4
    assert plan.winner is not None and plan.winner.deployment.gpus == 2
    winner = plan.winner.deployment
    assert (winner.decode_tp if winner.colocated else winner.prefill_tp) == 2
    assert "(TP 2)" in str(winner)


def test_colocated_wins_where_disaggregation_strands_capacity():
    """Long prompts and long answers at p90: one pool of 6 colocated replicas packs the prefill
    (~2.1 GPUs of work) and decode (~3.1) work; split pools need 3 + 4."""
    slo = Slo(ttft_s=1.0, itl_s=0.015, percentile=90)
    plan = search(H200, poisson(8, "8192+-1024", "1024+-256"), slo, 8, KV_BYTES)
    assert plan.winner is not None and plan.winner.deployment.colocated
    assert plan.winner.deployment.gpus == 6
    assert not [p for p in plan.evaluated if not p.deployment.colocated and p.meets(slo)]


def test_disaggregated_wins_where_prefill_steps_break_the_itl_tail():
    """At p99 ITL, a colocated replica's steps that carry a prompt chunk are too many and too
    long; a separate prefill pool keeps every decode step short, at the same 2 GPUs."""
    slo = Slo(ttft_s=1.0, itl_s=0.015, percentile=99)
    plan = search(H200, poisson(4, "4096", "512"), slo, 8, KV_BYTES, tp_sizes=TP1)
    assert plan.winner is not None and not plan.winner.deployment.colocated
    assert plan.winner.deployment.gpus == 2
    assert not [p for p in plan.evaluated if p.deployment.colocated and p.meets(slo)]


def test_an_unmeetable_slo_names_the_target_and_the_best_there_is():
    plan = search(H200, poisson(2, "2048", "64", 100), Slo(ttft_s=0.05, itl_s=0.05), 3, KV_BYTES, tp_sizes=TP1)
    assert plan.winner is None
    best = min(p.ttft_s for p in plan.evaluated)
    assert best > 0.05
    message = plan.shortfall()
    assert message.startswith("TTFT p90 <= 50 ms; the best is ") and f"{best * 1000:.3g} ms with " in message
