"""The planner's search: the fewest GPUs whose configuration meets both SLOs.

Candidates at g GPUs: colocated replicas, and every split into prefill and decode replicas, each
pool at every tensor-parallel size the profile has figures for (a replica of TP t holds t GPUs),
so that the replicas' GPUs add up to g, each with every max_num_batched_tokens of the grid. GPU counts are tried from 1 up; the first count at which
some candidate meets both targets wins, and there the candidate with the best goodput (then
the most headroom under the targets) is the answer, so colocated wins where it is as cheap,
disaggregated where it is cheaper. A candidate whose pool is saturated (`saturated_pool`) is
not simulated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.cluster.planning.queue_model import Deployment, Prediction, Slo, predict, saturated_pool
from splitserve.cluster.planning.workload import Workload
from splitserve.engine.simulated.step_time_profile import StepTimeProfile

BATCHED_TOKENS_GRID = (512, 2048, 8192)


def candidates(
    gpus: int, batched_tokens: tuple[int, ...], max_num_seqs: int = 64, tp_sizes: tuple[int, ...] = (1,)
) -> list[Deployment]:
    found = []
    for mbt in batched_tokens:
        for decode_tp in tp_sizes:
            if gpus % decode_tp == 0:
                found.append(Deployment(0, gpus // decode_tp, mbt, max_num_seqs, decode_tp=decode_tp))
            for prefill_tp in tp_sizes:
                for p in range(1, gpus // prefill_tp + 1):
                    left = gpus - p * prefill_tp
                    if left > 0 and left % decode_tp == 0:
                        found.append(Deployment(p, left // decode_tp, mbt, max_num_seqs, prefill_tp, decode_tp))
    return found


def headroom(prediction: Prediction, slo: Slo) -> float:
    """How far under the targets (the larger of the two ratios; < 1 meets both)."""
    return max(prediction.ttft_s / slo.ttft_s, prediction.itl_s / slo.itl_s)


def rank_key(prediction: Prediction, slo: Slo) -> tuple[bool, int, float, float]:
    """Those meeting both first, fewest GPUs first; then the others, best goodput first."""
    meets = prediction.meets(slo)
    return (not meets, prediction.deployment.gpus if meets else 0, -prediction.goodput, headroom(prediction, slo))


@dataclass
class Plan:
    slo: Slo
    winner: Prediction | None
    evaluated: list[Prediction]  # best first (rank_key)

    def runners_up(self, count: int) -> list[Prediction]:
        return [p for p in self.evaluated if p is not self.winner][:count]

    def shortfall(self) -> str:
        """Why nothing meets the SLOs: the target no configuration meets, and the closest."""
        slo, p = self.slo, f"p{self.slo.percentile:g}"
        best_ttft = min(self.evaluated, key=lambda x: (x.ttft_s, x.itl_s))
        best_itl = min(self.evaluated, key=lambda x: (x.itl_s, x.ttft_s))
        if best_ttft.ttft_s > slo.ttft_s:
            return f"TTFT {p} <= {_ms(slo.ttft_s)}; the best is {_ms(best_ttft.ttft_s)} with {_described(best_ttft)}"
        if best_itl.itl_s > slo.itl_s:
            return f"ITL {p} <= {_ms(slo.itl_s)}; the best is {_ms(best_itl.itl_s)} with {_described(best_itl)}"
        both = min(self.evaluated, key=lambda x: headroom(x, slo))
        return (
            f"TTFT {p} <= {_ms(slo.ttft_s)} and ITL {p} <= {_ms(slo.itl_s)} together; the closest is "
            f"TTFT {_ms(both.ttft_s)}, ITL {_ms(both.itl_s)} with {_described(both)}"
        )


def _ms(seconds: float) -> str:
    return "unbounded (saturated)" if math.isinf(seconds) else f"{seconds * 1000:.3g} ms"


def _described(prediction: Prediction) -> str:
    return f"{prediction.deployment} ({prediction.deployment.gpus} GPUs)"


def search(
    profile: StepTimeProfile,
    workload: Workload,
    slo: Slo,
    max_gpus: int,
    kv_bytes_per_token: int,
    batched_tokens: tuple[int, ...] = BATCHED_TOKENS_GRID,
    max_num_seqs: int = 64,
    tp_sizes: tuple[int, ...] | None = None,
) -> Plan:
    """tp_sizes: the tensor-parallel sizes searched per pool; None: every size the profile has."""
    sizes = tuple(profile.tensor_parallel_sizes) if tp_sizes is None else tp_sizes
    for size in sizes:
        profile.for_tensor_parallel(size)  # a size without figures: ConfigError, before any work
    evaluated: list[Prediction] = []
    for gpus in range(1, max_gpus + 1):
        here = []
        for deployment in candidates(gpus, batched_tokens, max_num_seqs, sizes):
            pool = saturated_pool(profile, workload, deployment)
            if pool is not None:
                here.append(Prediction(deployment, math.inf, math.inf, 0.0, pool, []))
            else:
                here.append(predict(profile, workload, deployment, slo, kv_bytes_per_token))
        evaluated += here
        if any(p.meets(slo) for p in here):
            break
    evaluated.sort(key=lambda p: rank_key(p, slo))
    winner = evaluated[0] if evaluated and evaluated[0].meets(slo) else None
    return Plan(slo, winner, evaluated)
