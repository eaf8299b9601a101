"""A cluster of simulated engines in virtual time: the real scheduler, block pool and KV
handoff of each replica (`SimulatedEngine`), stepped on a simulated clock instead of the wall
clock, so a minute of H200 serving runs in seconds on a shared 2-core box and measures the
same whatever the box's load. What `splitserve plan`'s queue model is checked against.

Each replica steps back to back while it has work; a step's outputs are seen at its start +
the profile's time for the batch the real scheduler composed (`SimulatedRunner.simulated_seconds`;
its wait is made negligible with a tiny speed factor). Requests arriving while a step runs
join the next one, as in the engine loop. Routing is the router's load rule: the decode
replica with the fewest requests in flight, the prefill replica with the fewest prompt tokens
queued. A disaggregated request is prefilled as a prefill-only sequence, its KV moved over the
prefill replica's link as the simulated transport times it (one transfer at a time, layer-wise:
it ends at max(prefill end + latency, link free + transfer time)), then reserved and admitted
on its decode replica with the prefill replica's first token (`reserve_prompt_blocks`,
`admit_prefilled`, `release_prefilled`). Not here: the router's prefix scoring (prompts share
no prefix), the request channels and the controller.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.cluster.planning.queue_model import Deployment
from splitserve.cluster.planning.workload import Workload
from splitserve.engine.config import EngineConfig
from splitserve.engine.simulated.simulated_engine import SimulatedEngine
from splitserve.proto.messages.handoff import PrefillResult
from splitserve.proto.messages.sampling_params import SamplingParams

NEGLIGIBLE_SPEED = 1e-9  # the runner's wall wait per simulated second


def long_context_copy(model: str | Path, out: str | Path, context: int = 65536) -> str:
    """A copy of a checkpoint's tokenizer and config with a longer context, for long simulated
    prompts on a tiny model (the simulated engine never reads the weights)."""
    out = Path(out)
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
            if (Path(model) / name).is_file():
                shutil.copy(Path(model) / name, out / name)
        config = json.loads((Path(model) / "config.json").read_text())
        config["max_position_embeddings"] = context
        (out / "config.json").write_text(json.dumps(config))
    return str(out)


@dataclass
class MeasuredRequest:
    arrival_s: float
    input_tokens: int
    token_times: list[float] = field(default_factory=list)  # when each token reached the client

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.arrival_s

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class _Replica:
    def __init__(self, engine: SimulatedEngine):
        self.engine = engine
        self.busy = False
        self.in_flight = 0
        self.queued_prompt_tokens = 0


def run_virtual_time(
    model: str, profile: str, workload: Workload, deployment: Deployment, kv_bytes_per_token: int, seed: int = 0
) -> list[MeasuredRequest]:
    """Serve every request of the workload; returns them in arrival order, with token times."""
    blocks = max(64, 2 * deployment.max_num_seqs * (workload.max_total_tokens // 16 + 2))

    def engine() -> _Replica:
        config = EngineConfig(
            model=model,
            engine="simulated",
            profile=profile,
            speed_factor=NEGLIGIBLE_SPEED,
            num_kv_blocks=blocks,
            max_num_seqs=deployment.max_num_seqs,
            max_num_batched_tokens=deployment.max_num_batched_tokens,
            max_model_len=workload.max_total_tokens + 1,
            async_scheduling=False,
            seed=seed,
        )
        return _Replica(SimulatedEngine(config))

    decode = [engine() for _ in range(deployment.decode_replicas)]
    prefill = [engine() for _ in range(deployment.prefill_replicas)]
    link_free = {id(r): 0.0 for r in prefill}
    link = (decode or prefill)[0].engine.profile.kv_link
    rng = random.Random(seed)
    measured = [MeasuredRequest(r.arrival_s, r.input_tokens) for r in workload.requests]
    decode_of: dict[str, _Replica] = {}
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    for index, request in enumerate(workload.requests):
        heapq.heappush(events, (request.arrival_s, next(order), "arrival", index))

    def wake(replica: _Replica, now: float) -> None:
        if not replica.busy and replica.engine.has_unfinished():
            runner = replica.engine.runner
            before = runner.simulated_seconds
            outputs = replica.engine.step()
            replica.busy = True
            heapq.heappush(events, (now + runner.simulated_seconds - before, next(order), "step", (replica, outputs)))

    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "arrival":
            assert isinstance(item, int)
            request = workload.requests[item]
            rid = str(item)
            prompt = [rng.randrange(10, 200) for _ in range(request.input_tokens)]
            params = SamplingParams(max_tokens=request.output_tokens)
            target = min(decode, key=lambda r: r.in_flight)
            target.in_flight += 1
            if deployment.colocated:
                target.engine.add_request(prompt_token_ids=prompt, params=params, request_id=rid)
                wake(target, now)
            else:
                decode_of[rid] = target
                chosen = min(prefill, key=lambda r: r.queued_prompt_tokens)
                chosen.queued_prompt_tokens += request.input_tokens
                seq = chosen.engine.make_sequence(None, prompt, params, rid, prefill_only=True)
                chosen.engine.add_sequence(seq)
                wake(chosen, now)
        elif kind == "handoff":
            assert isinstance(item, tuple)
            source, first = item
            target = decode_of.pop(first.request_id)
            seq = source.engine.scheduler.requests[first.request_id]
            params = seq.params
            moved = target.engine.make_sequence(None, list(seq.prompt_token_ids), params, first.request_id)
            assert target.engine.reserve_prompt_blocks(moved) is not None, "decode replica out of KV blocks"
            source.engine.release_prefilled(first.request_id)
            out = target.engine.admit_prefilled(first.request_id, first)
            measured[int(out.request_id)].token_times.append(now)
            if out.finished:
                target.in_flight -= 1
            wake(target, now)
        else:
            assert isinstance(item, tuple)
            replica, outputs = item
            replica.busy = False
            for out in outputs:
                request_ = measured[int(out.request_id)]
                if replica in prefill:  # prefilled: its KV moves to the decode replica
                    replica.queued_prompt_tokens -= request_.input_tokens
                    transfer = link.latency_s + request_.input_tokens * kv_bytes_per_token / link.bytes_per_s
                    done = max(now + link.latency_s, link_free[id(replica)] + transfer)
                    link_free[id(replica)] = done
                    first = PrefillResult(out.request_id, out.token_ids[0], None, 0, 0, 0, 0.0, 0.0)
                    heapq.heappush(events, (done, next(order), "handoff", (replica, first)))
                    continue
                request_.token_times += [now] * len(out.new_token_ids)
                if out.finished:
                    replica.in_flight -= 1
            wake(replica, now)
    return measured
