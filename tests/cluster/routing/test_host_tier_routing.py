"""The router credits the host KV tier: the index follows host-tagged KV events apart from device
ones, and a host hit scores below a device hit and above a miss -- checked with events from real
engines (the tiny model) whose device pools evicted the prompt into their host tiers."""

from __future__ import annotations

import pytest

from splitserve.cluster.routing.index import KVIndex
from splitserve.cluster.routing.replica_pools import DECODE, PREFILL
from splitserve.cluster.routing.router import Router
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.kv_events import HOST, KVEvent
from splitserve.proto.messages.sampling_params import SamplingParams


def test_index_keeps_the_tiers_apart():
    index = KVIndex()
    index.add_replica("a", 0, [1], host_hashes=[7])
    assert index.apply_events("a", [KVEvent(1, "stored", (2, 3), HOST), [2, "removed", [1], "device"]])
    assert index.num_blocks("a") == 0 and index.num_blocks("a", HOST) == 3
    assert index.apply_events("a", [[3, "stored", [1]]])  # a tier-less plain event: device
    assert index.tiered_prefix_match([1, 2, 3, 4]) == ({"a": 1}, {"a": 3})
    assert index.prefix_match([1, 2, 3]) == {"a": 1}  # device only, as before
    index.resync("a", 9, [5], host_hashes=[1])
    assert index.tiered_prefix_match([1, 5, 6]) == ({}, {"a": 2})  # host, then device: both count
    assert index.num_indexed_hashes == 1 and index.num_indexed_host_hashes == 1
    index.remove_replica("a")
    assert index.num_indexed_host_hashes == 0


def test_host_hit_weight_orders_device_host_miss():
    router = Router(RouterConfig(local_prefill_threshold=0), block_size=4, seed=1)
    tokens = list(range(33))  # 8 full blocks
    router.add_replica(DECODE, "d")
    for rid in ("dev", "host", "miss"):
        router.add_replica(PREFILL, rid)
    first = router.route(tokens)
    first.release_claims()
    hashes = first.block_hashes
    router.apply_events(PREFILL, "dev", [KVEvent(1, "stored", hashes)])
    router.apply_events(PREFILL, "host", [KVEvent(1, "stored", hashes, HOST)])
    decision = router.route(tokens)
    assert decision.prefill_replica == "dev" and decision.prefill_host_cached_tokens == 0
    decision.release_claims()
    router.remove_replica(PREFILL, "dev")
    decision = router.route(tokens)
    assert decision.prefill_replica == "host" and decision.reason == "kv-prefix"
    assert decision.prefill_cached_tokens == decision.prefill_host_cached_tokens == 32
    with pytest.raises(ValueError):
        RouterConfig(host_hit_weight=1.5)


def _engine(model: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, block_size=16, num_kv_blocks=8, kv_offloading_size=0.001))


def test_router_prefers_device_then_host_then_miss_from_real_engines(tiny_model):
    prompt = [(7 * i) % 300 + 50 for i in range(70)]  # 4 full blocks
    other = [(11 * i) % 300 + 60 for i in range(120)]  # fills the 8-block device pool
    greedy = SamplingParams(temperature=0, max_tokens=1)
    engines = {"dev": _engine(tiny_model), "host": _engine(tiny_model), "miss": _engine(tiny_model)}
    engines["dev"].generate([prompt], greedy)
    engines["host"].generate([prompt], greedy)
    engines["host"].generate([other], greedy)  # the prompt's blocks move to its host tier
    engines["miss"].generate([other], greedy)
    router = Router(RouterConfig(local_prefill_threshold=0), block_size=16)
    router.add_replica(DECODE, "d")
    for rid, engine in engines.items():
        router.add_replica(PREFILL, rid)
        assert router.apply_events(PREFILL, rid, engine.take_events())
    host_index = router.index(PREFILL)
    assert host_index.num_blocks("host", HOST) >= 4 and host_index.num_blocks("miss", HOST) == 0
    order = []
    for _ in engines:
        decision = router.route(prompt)
        order.append(decision.prefill_replica)
        decision.release_claims()
        router.remove_replica(PREFILL, decision.prefill_replica)
    assert order == ["dev", "host", "miss"]
    # The snapshot path indexes the same thing as the events did.
    fresh = KVIndex()
    seq, device_hashes, host_hashes = engines["host"].snapshot()
    fresh.add_replica("host", seq, device_hashes, host_hashes)
    assert fresh.tiered_prefix_match(router.route(prompt).block_hashes)[1]["host"] == 4
