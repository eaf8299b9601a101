"""The router's scoring policies: each a WorkerSelector that picks one replica of a pool for a
prompt, behind one interface (as Dynamo's kv_router WorkerSelector), chosen by
RouterConfig.policy. Pure Python, no torch.

  "kv"            KVSelector: cost-based, prefix-cache aware (the formula in router.py).
  "round-robin"   RoundRobinSelector: cycles over live replicas; ignores prefixes and load.
  "least-loaded"  LeastLoadedSelector: lowest queue_weight*queued_tokens + running_weight*running
                  (+ kv_usage_weight*kv_usage on decode); ignores prefixes.
  "random"        RandomSelector: uniform among live replicas.

Prefix-blind selectors do not consult the index: their picks report 0 cached tokens, and the
policy's name is the decision's reason.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.cluster.routing.adapter_affinity import adapter_cost
from splitserve.cluster.routing.index import KVIndex
from splitserve.cluster.routing.load import ReplicaLoad
from splitserve.cluster.routing.router_config import RouterConfig, RouterPolicy

TIE_EPSILON = 1e-6


@dataclass(frozen=True)
class PoolView:
    """What a selector sees of one pool for one request."""

    pool: str  # "prefill" | "decode"
    candidates: list[ReplicaLoad]  # live, not draining, not excluded; never empty
    index: KVIndex  # the pool's prefix index
    num_registered: int  # replicas in the pool, candidates or not
    kv_usage_weight: float  # the cost of a full KV cache (0 where it does not count: prefill)
    config: RouterConfig  # the router's current weights
    lora_adapter: str | None = None  # the request's adapter (None: the base model)


@dataclass(frozen=True)
class Selection:
    replica: ReplicaLoad
    cached_tokens: int  # prompt tokens the replica already caches, either tier (0 for prefix-blind selectors)
    reason: str  # "kv-prefix", "load", "load-over-prefix", or the blind policy's name
    host_tokens: int = 0  # of cached_tokens, those in the replica's host KV tier (loaded, not recomputed)


class WorkerSelector(ABC):
    """Picks one replica of a pool for a prompt of num_tokens tokens whose full blocks hash to
    hashes. May keep state across calls (a cursor); is called from one thread."""

    @abstractmethod
    def select(self, view: PoolView, hashes: tuple[int, ...], num_tokens: int) -> Selection: ...


def _load_cost(view: PoolView, load: ReplicaLoad) -> float:
    cfg = view.config
    return (
        cfg.queue_weight * load.effective_queued_tokens
        + cfg.running_weight * load.effective_running
        + view.kv_usage_weight * load.report.kv_usage
    )


class KVSelector(WorkerSelector):
    """Lowest cost: load + work left - credit for the cached prefix + loading the request's LoRA
    adapter where it is not in the device slots (adapter_affinity.py); ties broken by rng. A prefix
    block in a replica's host KV tier is credited at `host_hit_weight` of a device block (it is
    loaded back, not recomputed, but the load costs something), so device hit > host hit > miss."""

    def __init__(self, rng: random.Random, block_size: int):
        self.rng = rng
        self.block_size = block_size

    def select(self, view: PoolView, hashes: tuple[int, ...], num_tokens: int) -> Selection:
        cands = view.candidates
        all_registered = len(cands) == view.num_registered
        device, either = view.index.tiered_prefix_match(
            hashes, None if all_registered else [c.replica_id for c in cands]
        )
        pw, hw, bs = view.config.prefix_weight, view.config.host_hit_weight, self.block_size
        max_cached = num_tokens - 1
        best_cost = float("inf")
        ties: list[tuple[ReplicaLoad, int, int]] = []
        for load in cands:
            rid = load.replica_id
            on_device = min(device.get(rid, 0) * bs, max_cached) if device else 0
            cached = min(either.get(rid, 0) * bs, max_cached) if either else 0
            credited = on_device + hw * (cached - on_device)
            cost = _load_cost(view, load) + (num_tokens - credited) - pw * credited
            cost += adapter_cost(load, view.lora_adapter, view.config)
            if cost < best_cost - TIE_EPSILON:
                best_cost = cost
                ties = [(load, cached, cached - on_device)]
            elif cost <= best_cost + TIE_EPSILON:
                ties.append((load, cached, cached - on_device))
        chosen, cached, on_host = ties[0] if len(ties) == 1 else self.rng.choice(ties)
        best_blocks = max(either.values(), default=0)
        if best_blocks == 0:
            reason = "load"
        elif either.get(chosen.replica_id, 0) == best_blocks:
            reason = "kv-prefix"
        else:
            reason = "load-over-prefix"  # a longer prefix existed but its replica was busier
        return Selection(chosen, cached, reason, on_host)


class RoundRobinSelector(WorkerSelector):
    def __init__(self) -> None:
        self.cursors: dict[str, int] = {}

    def select(self, view: PoolView, hashes: tuple[int, ...], num_tokens: int) -> Selection:
        cursor = self.cursors.get(view.pool, 0)
        self.cursors[view.pool] = cursor + 1
        return Selection(view.candidates[cursor % len(view.candidates)], 0, "round-robin")


class RandomSelector(WorkerSelector):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def select(self, view: PoolView, hashes: tuple[int, ...], num_tokens: int) -> Selection:
        return Selection(self.rng.choice(view.candidates), 0, "random")


class LeastLoadedSelector(WorkerSelector):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def select(self, view: PoolView, hashes: tuple[int, ...], num_tokens: int) -> Selection:
        costs = [_load_cost(view, load) for load in view.candidates]
        best = min(costs)
        ties = [load for load, cost in zip(view.candidates, costs, strict=True) if cost <= best + TIE_EPSILON]
        return Selection(ties[0] if len(ties) == 1 else self.rng.choice(ties), 0, "least-loaded")


# policy -> its selector, given the router's rng (shared, so one seed fixes every tie) and block size
SELECTORS: dict[RouterPolicy, Callable[[random.Random, int], WorkerSelector]] = {
    "kv": KVSelector,
    "round-robin": lambda rng, block_size: RoundRobinSelector(),
    "least-loaded": lambda rng, block_size: LeastLoadedSelector(rng),
    "random": lambda rng, block_size: RandomSelector(rng),
}


def make_selector(policy: RouterPolicy, rng: random.Random, block_size: int) -> WorkerSelector:
    return SELECTORS[policy](rng, block_size)
