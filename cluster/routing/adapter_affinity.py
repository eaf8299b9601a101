"""Adapter affinity: what a LoRA adapter's residency on a replica adds to the router's cost
(token-equivalents, as the rest of router.py's formula). Pure Python, no torch.

A replica reports, with its KV events (the same poll reply or pushed frame), the adapters its
device slots hold and those in its host cache (EngineStats.lora_device_adapters /
lora_host_adapters; routing/load.py). For a request with an adapter:

  adapter_cost(r) = 0                            adapter in r's device slots
                  = adapter_host_load_tokens     in r's host cache: copied to a slot first
                  = adapter_load_tokens          on neither: read from its checkpoint first
                  + adapter_host_load_tokens     ... and r's slots are all taken: loading it
                                                 evicts an adapter, which a later request
                                                 loads back from the host cache

Both weights are load seconds expressed in prefill tokens (load seconds / prefill seconds
per token; RouterConfig cites the measurement). The cost is a fixed amount, not a gate: the
holder of a hot adapter wins until its queue outweighs one load, then a second replica takes
the adapter (spreading it), and the router marks it resident there at once (ReplicaLoad.
routed_adapters) so a burst does not load it everywhere. The eviction term makes a cold
adapter go where a slot is free rather than push out one in use.
"""

from __future__ import annotations

from collections import Counter
from typing import Final, Literal

from splitserve.cluster.routing.load import ReplicaLoad
from splitserve.cluster.routing.router_config import RouterConfig

Residency = Literal["device", "host", "none"]
ON_DEVICE: Final = "device"
ON_HOST: Final = "host"
NOT_LOADED: Final = "none"


def residency(load: ReplicaLoad, adapter: str) -> Residency:
    """Where the replica holds the adapter, as it last reported, plus the adapters routed
    there since (the engine loads those to serve them)."""
    report = load.report
    if adapter in report.device_adapters or adapter in load.routed_adapters:
        return ON_DEVICE
    if adapter in report.host_adapters:
        return ON_HOST
    return NOT_LOADED


def reported_on_device(load: ReplicaLoad, adapter: str) -> bool:
    """The replica's own last report puts the adapter in its slots (the adapter-hit metric's
    test: the router's guesses since the report do not count)."""
    return adapter in load.report.device_adapters


def adapter_cost(load: ReplicaLoad, adapter: str | None, config: RouterConfig) -> float:
    """The adapter's share of cost(r): 0 for a base-model request or a replica serving no LoRA."""
    if adapter is None or load.report.lora_slots == 0:
        return 0.0
    where = residency(load, adapter)
    if where == ON_DEVICE:
        return 0.0
    cost = config.adapter_host_load_tokens if where == ON_HOST else config.adapter_load_tokens
    if len(load.report.device_adapters | load.routed_adapters) >= load.report.lora_slots:
        cost += config.adapter_host_load_tokens  # it evicts one, loaded back later
    return cost


class AdapterHits:
    """The router's adapter-hit share: LoRA requests routed per pool, and those sent to a
    replica whose last report had their adapter in its device slots."""

    def __init__(self) -> None:
        self.routes: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()

    def note(self, adapter: str | None, *picked: tuple[str, ReplicaLoad]) -> tuple[tuple[str, bool], ...]:
        """Count a hit or miss per (pool, replica) routed to, then mark the adapter resident on
        each until its next report (it loads the adapter to serve the request). Returns the
        (pool, hit) pairs; () for a base-model request."""
        if adapter is None:
            return ()
        samples = []
        for pool, load in picked:
            hit = reported_on_device(load, adapter)
            self.routes[pool] += 1
            self.hits[pool] += hit
            load.routed_adapters.add(adapter)
            samples.append((pool, hit))
        return tuple(samples)

    def counts(self, pool: str) -> tuple[int, int]:
        return self.routes[pool], self.hits[pool]
