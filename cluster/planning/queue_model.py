"""The queue model: a discrete-event simulation of a deployment serving a workload, in
simulated seconds, from which TTFT and ITL at a percentile and goodput are read.

Why a simulation and not a closed form: the scheduler batches (a step packs decode tokens and
prompt chunks under one token budget, and its time depends on the whole batch), decode ITL
depends on the batch size and context at each step, and a trace's bursts are not a steady
state. M/G/c formulas hold only at a steady Poisson load and see neither batching nor chunking;
the simulation of each replica (`replica_model.py`) follows the scheduler's rules and is O(1)
per step, so a deployment of a few thousand requests takes well under a second, and every
configuration the planner compares sees the same requests. tests/cluster/planning/ checks it
against M/M/1 at its limits and against the simulated engine's real scheduler.

The path of a request, as the router sends it:
- colocated (no prefill pool): to the decode replica with the fewest requests in flight, which
  prefills it in chunks inside its continuous batch, then decodes it;
- disaggregated: a decode replica is picked at arrival (fewest in flight) and a prefill replica
  (fewest prompt tokens queued); the prefill replica computes the prompt and samples the first
  token; the KV moves over the prefill replica's link (one transfer at a time; layer-wise, so
  it overlaps the forward: it ends at max(prefill end + latency, link free + transfer time));
  then the decode replica admits it, with the first token, and it joins the running batch at
  the next step (as `Scheduler.add_prefilled` does). TTFT is that admission.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from splitserve.cluster.planning.replica_model import PlannedOutcome, ReplicaModel
from splitserve.cluster.planning.workload import Workload
from splitserve.engine.simulated.step_time_profile import StepTimeProfile


@dataclass(frozen=True)
class Deployment:
    """prefill_replicas 0: colocated (decode replicas prefill locally). A replica of a pool
    holds that pool's tensor-parallel size of GPUs, and steps by the profile's figures for it."""

    prefill_replicas: int
    decode_replicas: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def colocated(self) -> bool:
        return self.prefill_replicas == 0

    @property
    def gpus(self) -> int:
        return self.prefill_replicas * self.prefill_tp + self.decode_replicas * self.decode_tp

    def __str__(self) -> str:
        def pool(count: int, tp: int, kind: str) -> str:
            return f"{count}{kind}" + (f" (TP {tp})" if tp > 1 else "")

        shape = (
            pool(self.decode_replicas, self.decode_tp, " colocated")
            if self.colocated
            else f"{pool(self.prefill_replicas, self.prefill_tp, 'P')}+{pool(self.decode_replicas, self.decode_tp, 'D')}"
        )
        return f"{shape}, max_num_batched_tokens {self.max_num_batched_tokens}"


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float
    percentile: float = 90.0

    def max_slow_gaps(self, gaps: int) -> int:
        """Gaps over the ITL target a request may have and still meet it at the percentile
        (nearest rank: its p-th gap is within the target)."""
        return gaps - math.ceil(self.percentile / 100 * gaps)


@dataclass
class Prediction:
    deployment: Deployment
    ttft_s: float  # at the SLO's percentile, over requests
    itl_s: float  # at the SLO's percentile, over every inter-token gap
    goodput: float  # share of requests meeting both targets
    saturated: str | None  # the pool whose offered load exceeds what it can serve, if any
    outcomes: list[PlannedOutcome]

    def meets(self, slo: Slo) -> bool:
        return self.saturated is None and self.ttft_s <= slo.ttft_s and self.itl_s <= slo.itl_s


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def weighted_percentile(pairs: list[tuple[float, int]], p: float) -> float:
    """The p-th percentile of values each counted weight times (steps weighted by the gaps
    they make: one per decoding sequence)."""
    total = sum(w for _, w in pairs)
    if not total:
        return 0.0
    threshold, seen = p / 100 * total, 0
    for value, weight in sorted(pairs):
        seen += weight
        if seen >= threshold:
            return value
    return max(v for v, _ in pairs)


def saturated_pool(profile: StepTimeProfile, workload: Workload, deployment: Deployment) -> str | None:
    """A pool whose offered work exceeds its capacity over the workload, from lower bounds on
    the work: prompt tokens at the profile's compute rate, decode tokens at the cost per token
    of a full batch (max_num_seqs sequences at the workload's mean context)."""
    duration = workload.duration_s
    if duration <= 0:
        return None
    requests = workload.requests
    decode_profile = profile.for_tensor_parallel(deployment.decode_tp)
    prompt_tokens = sum(r.input_tokens for r in requests)
    batch = deployment.max_num_seqs
    mean_context = sum(r.input_tokens + r.output_tokens / 2 for r in requests) / len(requests)
    per_token_s = decode_profile.decode_s(batch, int(batch * mean_context)) / batch
    decode_s = sum(r.output_tokens - 1 for r in requests) * per_token_s
    if deployment.colocated:
        prompt_s = prompt_tokens * decode_profile.token_compute_s
        return "colocated" if (prompt_s + decode_s) / deployment.decode_replicas >= duration else None
    prompt_s = prompt_tokens * profile.for_tensor_parallel(deployment.prefill_tp).token_compute_s
    if prompt_s / deployment.prefill_replicas >= duration:
        return "prefill"
    return "decode" if decode_s / deployment.decode_replicas >= duration else None


def predict(
    profile: StepTimeProfile,
    workload: Workload,
    deployment: Deployment,
    slo: Slo,
    kv_bytes_per_token: int = 0,
    layerwise_transfer: bool = True,
) -> Prediction:
    """Simulate the workload on the deployment. A saturated pool's percentiles are infinite."""
    budget, seqs, itl = deployment.max_num_batched_tokens, deployment.max_num_seqs, slo.itl_s
    decode_profile = profile.for_tensor_parallel(deployment.decode_tp)
    prefill_profile = profile.for_tensor_parallel(deployment.prefill_tp) if not deployment.colocated else profile
    decode = [ReplicaModel(decode_profile, budget, seqs, itl) for _ in range(deployment.decode_replicas)]
    prefill = [ReplicaModel(prefill_profile, budget, seqs, itl, True) for _ in range(deployment.prefill_replicas)]
    link_free = [0.0] * len(prefill)
    replica_index = {id(r): i for i, r in enumerate(prefill)}
    decode_of: dict[int, ReplicaModel] = {}
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    outcomes = [PlannedOutcome(r.arrival_s, r.input_tokens, r.output_tokens) for r in workload.requests]
    for outcome in outcomes:
        heapq.heappush(events, (outcome.arrival_s, next(order), "arrival", outcome))

    def give(replica: ReplicaModel, outcome: PlannedOutcome, now: float) -> None:
        replica.add(outcome)
        if replica.busy_until is None:
            heapq.heappush(events, (replica.start_step(now), next(order), "step", replica))

    def hand_off(replica: ReplicaModel, prefilled: list[PlannedOutcome], now: float) -> None:
        """Queue the KV transfers of the prompts a prefill replica finished at now."""
        link = replica_index[id(replica)]
        for outcome in prefilled:
            if outcome.output_tokens == 1:  # done with its first token: no KV to move
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

    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "arrival":
            assert isinstance(item, PlannedOutcome)
            target = min(decode, key=lambda r: r.assigned)
            target.assigned += 1
            if deployment.colocated:
                give(target, item, now)
            else:
                decode_of[id(item)] = target
                give(min(prefill, key=lambda r: r.queued_prompt_tokens), item, now)
        elif kind == "handoff":
            assert isinstance(item, PlannedOutcome)
            item.first_token_s = now  # the decode replica admits it with the prefill's first token
            give(decode_of.pop(id(item)), item, now)
        else:
            assert isinstance(item, ReplicaModel)
            # The replica steps on by itself while its next step ends before every queued event
            # (at a tie the queued one goes first, as its lower sequence number would put it):
            # the same steps in the same order as going through the heap, without the heap.
            while True:
                prefilled, _ = item.finish_step()
                if item.prefill_only and prefilled:
                    hand_off(item, prefilled, now)
                if not item.has_work:
                    break
                end = item.start_step(now)
                if events and events[0][0] <= end:
                    heapq.heappush(events, (end, next(order), "step", item))
                    break
                now = end

    saturated = saturated_pool(profile, workload, deployment)
    steps = [pair for replica in decode for pair in replica.step_log]
    p = slo.percentile
    good = sum(o.ttft_s <= slo.ttft_s and o.slow_gaps <= slo.max_slow_gaps(o.gaps) for o in outcomes)
    return Prediction(
        deployment,
        math.inf if saturated else percentile([o.ttft_s for o in outcomes], p),
        math.inf if saturated in ("decode", "colocated") else weighted_percentile(steps, p),
        0.0 if saturated else good / len(outcomes),
        saturated,
        outcomes,
    )
