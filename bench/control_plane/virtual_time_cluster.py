"""A cluster of simulated engines in virtual time: the real scheduler, block pool and KV
handoff of each replica (`SimulatedEngine`), stepped on a simulated clock instead of the wall
clock, so a minute of H200 serving runs in seconds on a shared 2-core box and measures the
same whatever the box's load. What `splitserve plan`'s queue model is checked against, and
what the autoscaling policies drive in the bursty-trace benchmark (virtual_autoscaling.py).

Each replica steps back to back while it has work; a step's outputs are seen at its start +
the profile's time for the batch the real scheduler composed (`SimulatedRunner.simulated_seconds`;
its wait is made negligible with a tiny speed factor). Requests arriving while a step runs
join the next one, as in the engine loop. Routing is the router's load rule over the replicas
that are routable (started and not draining): the decode replica with the fewest requests in
flight, the prefill replica with the fewest prompt tokens queued. A disaggregated request is
prefilled as a prefill-only sequence, its KV moved over the prefill replica's link as the
simulated transport times it (one transfer at a time, layer-wise: it ends at
max(prefill end + latency, link free + transfer time)), then reserved and admitted on its
decode replica with the prefill replica's first token (`reserve_prompt_blocks`,
`admit_prefilled`, `release_prefilled`).

Replicas can be added while it runs (routable from `ready_at`: the start-up delay) and drained
(no new requests; removed once every request routed to it has finished, or for a prefill
replica, has been handed off). `run_until` stops after each replica that becomes ready or is
removed, so a driver sees those moments on the virtual clock. Not here: the router's prefix
scoring (prompts share no prefix), the request channels and the controller.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.cluster.planning.queue_model import Deployment
from splitserve.cluster.planning.workload import PlannedRequest, Workload
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.engine.config import EngineConfig
from splitserve.engine.simulated.simulated_engine import SimulatedEngine
from splitserve.proto.messages.handoff import PrefillResult
from splitserve.proto.messages.sampling_params import SamplingParams

PROMPT_TOKEN_IDS = range(10, 200)

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
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # when each token reached the client

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.arrival_s

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def finished(self) -> bool:
        return len(self.token_times) >= self.output_tokens


class Replica:
    def __init__(self, replica_id: str, pool: str, engine: SimulatedEngine, started_at: float, ready_at: float):
        self.replica_id = replica_id
        self.pool = pool
        self.engine = engine
        self.started_at, self.ready_at = started_at, ready_at
        self.removed_at: float | None = None
        self.draining = False
        self.busy = False
        self.in_flight = 0  # requests routed here and not yet finished (prefill: not yet handed off)
        self.queued_prompt_tokens = 0
        self.link_free = 0.0


class VirtualTimeCluster:
    """colocated: decode replicas prefill locally (no prefill pool). Every replica has
    max_num_seqs, max_num_batched_tokens and num_kv_blocks (None: enough that no sequence of
    max_total_tokens is ever preempted at max_num_seqs)."""

    def __init__(
        self,
        model: str,
        profile: str,
        colocated: bool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_total_tokens: int,
        kv_bytes_per_token: int,
        num_kv_blocks: int | None = None,
        seed: int = 0,
    ):
        self.colocated = colocated
        self.kv_bytes_per_token = kv_bytes_per_token
        blocks = num_kv_blocks or max(64, 2 * max_num_seqs * (max_total_tokens // 16 + 2))
        self.engine_config = EngineConfig(
            model=model,
            engine="simulated",
            profile=profile,
            speed_factor=NEGLIGIBLE_SPEED,
            num_kv_blocks=blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_total_tokens + 1,
            async_scheduling=False,
            seed=seed,
        )
        self.pools: dict[str, list[Replica]] = {PREFILL: [], DECODE: []}
        self.removed: list[Replica] = []
        self.requests: list[MeasuredRequest] = []
        self.now = 0.0
        self._rng = random.Random(seed)
        self._events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self._ids = itertools.count()
        self._decode_of: dict[str, Replica] = {}
        self._changed: list[Replica] = []  # became ready or were removed at this moment
        # Called as tokens reach the client (the request, how many are new): an ingress's view.
        self.on_tokens: Callable[[MeasuredRequest, int], None] | None = None

    # ---- membership ------------------------------------------------------------------------
    def add_replica(self, pool: str, startup_s: float = 0.0) -> Replica:
        replica = Replica(f"{pool}-{next(self._ids)}", pool, SimulatedEngine(self.engine_config), self.now, 0.0)
        replica.ready_at = self.now + startup_s
        self.pools[pool].append(replica)
        if startup_s > 0:
            self._push(replica.ready_at, "ready", replica)
        return replica

    def routable(self, pool: str) -> list[Replica]:
        return [r for r in self.pools[pool] if r.ready_at <= self.now and not r.draining]

    def drain(self, replica: Replica) -> bool:
        """No new requests; removed once the last one routed to it is done (True: at once)."""
        replica.draining = True
        self._remove_if_drained(replica)
        idle, self._changed = bool(self._changed), []
        return idle

    def gpu_seconds(self, gpus_per_replica: dict[str, float]) -> float:
        """Provisioned time up to now: every replica from its start (start-up included) until
        removed (its drain included)."""
        replicas = [r for pool in self.pools.values() for r in pool] + self.removed
        return sum(
            ((self.now if r.removed_at is None else r.removed_at) - r.started_at) * gpus_per_replica[r.pool]
            for r in replicas
        )

    # ---- requests --------------------------------------------------------------------------
    def submit(self, request: PlannedRequest) -> MeasuredRequest:
        measured = MeasuredRequest(request.arrival_s, request.input_tokens, request.output_tokens)
        self.requests.append(measured)
        self._push(request.arrival_s, "arrival", len(self.requests) - 1)
        return measured

    def busy(self) -> bool:
        return bool(self._events)

    def next_event_at(self) -> float | None:
        return self._events[0][0] if self._events else None

    def run_until(self, until: float) -> list[Replica]:
        """Process every event at or before `until` (the clock then reads `until`); returns
        early, with the clock at that moment, the replicas that just became ready or were
        removed (empty: `until` was reached)."""
        while self._events and self._events[0][0] <= until:
            now, _, kind, item = heapq.heappop(self._events)
            self.now = now
            getattr(self, f"_on_{kind}")(item)
            if self._changed:
                changed, self._changed = self._changed, []
                return changed
        self.now = max(self.now, until)
        return []

    # ---- events ----------------------------------------------------------------------------
    def _push(self, at: float, kind: str, item: object) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, item))

    def _wake(self, replica: Replica) -> None:
        if not replica.busy and replica.engine.has_unfinished():
            runner = replica.engine.runner
            before = runner.simulated_seconds
            outputs = replica.engine.step()
            replica.busy = True
            self._push(self.now + runner.simulated_seconds - before, "step", (replica, outputs))

    def _on_ready(self, replica: Replica) -> None:
        self._changed.append(replica)

    def _on_arrival(self, index: int) -> None:
        request = self.requests[index]
        rid = str(index)
        # choices, not a randrange per token: a fifth of the time, and these prompts are most of a
        # run's random numbers (the ids only feed the block hashes and the simulated tokens)
        prompt = self._rng.choices(PROMPT_TOKEN_IDS, k=request.input_tokens)
        params = SamplingParams(max_tokens=request.output_tokens)
        target = min(self.routable(DECODE), key=lambda r: r.in_flight)
        target.in_flight += 1
        if self.colocated:
            target.engine.add_request(prompt_token_ids=prompt, params=params, request_id=rid)
            self._wake(target)
            return
        self._decode_of[rid] = target
        chosen = min(self.routable(PREFILL), key=lambda r: r.queued_prompt_tokens)
        chosen.queued_prompt_tokens += request.input_tokens
        chosen.in_flight += 1
        chosen.engine.add_sequence(chosen.engine.make_sequence(None, prompt, params, rid, prefill_only=True))
        self._wake(chosen)

    def _on_handoff(self, item: tuple[Replica, PrefillResult]) -> None:
        source, first = item
        target = self._decode_of.pop(first.request_id)
        seq = source.engine.scheduler.requests[first.request_id]
        moved = target.engine.make_sequence(None, list(seq.prompt_token_ids), seq.params, first.request_id)
        assert target.engine.reserve_prompt_blocks(moved) is not None, "decode replica out of KV blocks"
        source.engine.release_prefilled(first.request_id)
        source.in_flight -= 1
        out = target.engine.admit_prefilled(first.request_id, first)
        self._deliver(self.requests[int(out.request_id)], 1)
        if out.finished:
            target.in_flight -= 1
        self._wake(target)
        self._remove_if_drained(target)
        self._remove_if_drained(source)

    def _on_step(self, item: tuple[Replica, list]) -> None:
        replica, outputs = item
        replica.busy = False
        for out in outputs:
            request = self.requests[int(out.request_id)]
            if replica.pool == PREFILL:  # prefilled: its KV moves to the decode replica
                replica.queued_prompt_tokens -= request.input_tokens
                link = replica.engine.profile.kv_link
                transfer = link.latency_s + request.input_tokens * self.kv_bytes_per_token / link.bytes_per_s
                replica.link_free = max(self.now + link.latency_s, replica.link_free + transfer)
                first = PrefillResult(out.request_id, out.token_ids[0], None, 0, 0, 0, 0.0, 0.0)
                self._push(replica.link_free, "handoff", (replica, first))
                continue
            self._deliver(request, len(out.new_token_ids))
            if out.finished:
                replica.in_flight -= 1
        self._wake(replica)
        self._remove_if_drained(replica)

    def _deliver(self, request: MeasuredRequest, count: int) -> None:
        request.token_times += [self.now] * count
        if self.on_tokens is not None and count:
            self.on_tokens(request, count)

    def _remove_if_drained(self, replica: Replica) -> None:
        if replica.draining and not replica.in_flight and not replica.busy and replica.removed_at is None:
            replica.removed_at = self.now
            self.pools[replica.pool].remove(replica)
            self.removed.append(replica)
            self._changed.append(replica)


def run_virtual_time(
    model: str, profile: str, workload: Workload, deployment: Deployment, kv_bytes_per_token: int, seed: int = 0
) -> list[MeasuredRequest]:
    """Serve every request of the workload on a fixed deployment; returns them in arrival
    order, with token times."""
    cluster = VirtualTimeCluster(
        model,
        profile,
        deployment.colocated,
        deployment.max_num_seqs,
        deployment.max_num_batched_tokens,
        workload.max_total_tokens,
        kv_bytes_per_token,
        seed=seed,
    )
    for pool, count in ((DECODE, deployment.decode_replicas), (PREFILL, deployment.prefill_replicas)):
        for _ in range(count):
            cluster.add_replica(pool)
    for request in workload.requests:
        cluster.submit(request)
    cluster.run_until(float("inf"))
    return cluster.requests
