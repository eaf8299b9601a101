"""Adapter-aware routing (cluster/routing/adapter_affinity.py), fed the messages replicas send:
each simulated replica keeps its adapters in LRU device slots as an engine with a host cache
does, stores its prompts' blocks (hashed with the adapter, as engines hash them), and reports
both in a PollReply (KV events + EngineStats.lora_device_adapters), encoded and decoded, which
the router applies as RoutedReplicas.apply_now does. With 2 decode replicas and 8 adapters
whose requests repeat, the kv policy's adapter-hit share beats round-robin's; a hot adapter
spreads under load; a cold one goes to a free slot; device < host < none."""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import pytest

from splitserve.cluster.routing.adapter_affinity import NOT_LOADED, ON_DEVICE, ON_HOST, residency
from splitserve.cluster.routing.load import LoadReport
from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.cluster.routing.router import Router
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.kv_events import KVEvent
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals

ADAPTERS = [f"tenant-{i}" for i in range(8)]
SLOTS = 4  # per replica: the 2 replicas hold all 8 adapters only if each keeps its own half


class SimReplica:
    """An engine's LoRA slots (LRU, SLOTS of them) and prefix cache, as its poll reply shows them."""

    def __init__(self, slots: int = SLOTS):
        self.slots = slots
        self.device: OrderedDict[str, None] = OrderedDict()
        self.host: list[str] = []
        self.blocks: set[int] = set()
        self.seq = 0
        self.events: list[KVEvent] = []
        self.running = 0
        self.loads = 0

    def serve(self, adapter: str, block_hashes: tuple[int, ...]) -> None:
        if adapter in self.device:
            self.device.move_to_end(adapter)
        else:
            self.loads += 1
            if len(self.device) == self.slots:
                self.device.popitem(last=False)
            self.device[adapter] = None
        new = tuple(h for h in block_hashes if h not in self.blocks)
        if new:
            self.blocks.update(new)
            self.seq += 1
            self.events.append(KVEvent(self.seq, "stored", new))

    def reply(self) -> PollReply:
        engine = EngineStats(
            num_free_blocks=100,
            num_blocks=100,
            kv_usage=0.0,
            num_running=self.running,
            num_waiting=0,
            num_waiting_tokens=0,
            num_preemptions=0,
            num_computed_prompt_tokens=0,
            num_prefix_hit_tokens=0,
            lora_slots=self.slots,
            lora_slots_used=len(self.device),
            lora_device_adapters=sorted(self.device),
            lora_host_adapters=self.host,
        )
        events, self.events = self.events, []
        reply = PollReply(events, engine, num_pinned=0, num_active=self.running, transfer=TransferTotals())
        return PollReply.from_bytes(reply.to_bytes())  # what crosses the wire


def apply(router: Router, rid: str, replica: SimReplica) -> None:
    reply = replica.reply()
    assert router.apply_events(DECODE, rid, reply.events)
    router.update_load(DECODE, rid, LoadReport.from_poll(reply))


def decode_router(policy: str, num: int = 2, seed: int = 0) -> tuple[Router, dict[str, SimReplica]]:
    router = Router(RouterConfig(policy=policy, local_prefill_threshold=10_000), block_size=16, seed=seed)
    replicas = {f"d{i}": SimReplica() for i in range(num)}
    for rid, replica in replicas.items():
        router.add_replica(DECODE, rid)
        apply(router, rid, replica)
    return router, replicas


def run_repeating_workload(policy: str, in_flight: int, num_requests: int = 400) -> tuple[float, int]:
    """Requests for 8 adapters, 2 prompts each, in a seeded random order, with in_flight
    others still running when one is routed (the oldest ends as a new one comes; 0: each ends
    before the next). Returns (adapter-hit share, adapter loads)."""
    router, replicas = decode_router(policy)
    rng = random.Random(7)
    prompts = {
        a: [[(31 * i + 7 * j + 3 * k) % 400 + 20 for j in range(48)] for k in range(2)] for i, a in enumerate(ADAPTERS)
    }
    flight: deque = deque()
    for _ in range(num_requests):
        adapter = rng.choice(ADAPTERS)
        decision = router.route(rng.choice(prompts[adapter]), lora_adapter=adapter)
        assert decision.local_prefill
        replica = replicas[decision.decode_replica]
        replica.serve(adapter, decision.block_hashes)
        replica.running += 1
        flight.append((decision, replica))
        if len(flight) > in_flight:
            done, ended = flight.popleft()
            ended.running -= 1
            done.release_claims()
        for rid, r in replicas.items():
            apply(router, rid, r)
    routed, hits = router.adapter_hit_counts()[DECODE]
    assert routed == num_requests
    return hits / routed, sum(r.loads for r in replicas.values())


@pytest.mark.parametrize("in_flight", [0, 1])
def test_adapter_hit_share_beats_round_robin_on_repeating_requests(in_flight):
    kv_share, kv_loads = run_repeating_workload("kv", in_flight)
    rr_share, rr_loads = run_repeating_workload("round-robin", in_flight)
    assert kv_share > rr_share + 0.2, (kv_share, rr_share)
    assert kv_loads < rr_loads


def test_residency_scores_device_below_host_below_none():
    router, replicas = decode_router("kv", num=3)
    replicas["d0"].device["a"] = None
    replicas["d1"].host = ["a"]
    for rid, replica in replicas.items():
        apply(router, rid, replica)
    loads = {rid: router.load(DECODE, rid) for rid in replicas}
    assert [residency(loads[r], "a") for r in ("d0", "d1", "d2")] == [ON_DEVICE, ON_HOST, NOT_LOADED]
    prompt = list(range(40))
    picks = []
    for _ in range(3):
        decision = router.route(prompt, lora_adapter="a")
        picks.append(decision.decode_replica)
        router.remove_replica(DECODE, decision.decode_replica)  # next: the best of the rest
    assert picks == ["d0", "d1", "d2"]


def test_a_hot_adapter_spreads_under_load_and_is_marked_where_it_went():
    router, replicas = decode_router("kv")
    replicas["d0"].device["hot"] = None
    apply(router, "d0", replicas["d0"])
    picks = [router.route([i % 300 + 1 for i in range(40 + n)], lora_adapter="hot").decode_replica for n in range(12)]
    assert picks[0] == "d0"  # idle and holding it: no load to pay
    assert set(picks) == {"d0", "d1"}  # its queue outweighed one load: d1 took it too
    assert residency(router.load(DECODE, "d1"), "hot") == ON_DEVICE  # routed there, before any report
    # Only the request that found it reported resident is a hit.
    routed, hits = router.adapter_hit_counts()[DECODE]
    assert routed == 12 and hits == picks.count("d0")


def test_a_cold_adapter_takes_a_free_slot_rather_than_evict():
    router, replicas = decode_router("kv")
    for name in ("hot", "b", "c", "d"):
        replicas["d0"].device[name] = None  # d0's slots are full
    replicas["d1"].device["hot"] = None  # d1 has free slots
    for rid, replica in replicas.items():
        apply(router, rid, replica)
    for n in range(3):
        decision = router.route([n + 1] * 40, lora_adapter=f"cold-{n}")
        assert decision.decode_replica == "d1"
        decision.release_claims()
    # A base-model request pays nothing for adapters: both replicas stay candidates.
    assert {router.route([7] * 40 + [n]).decode_replica for n in range(20)} == {"d0", "d1"}
