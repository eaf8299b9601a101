"""Host KV tier metrics: a real tiered engine's stats cross the poll wire and become the pool's
host-tier series (stored / loaded / evicted blocks, prompt tokens by tier, load seconds, usage);
the ingress's indexed-blocks gauge splits by tier only when the tier is on; the setting reaches
the engines."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.cluster.control.worker_pool import engine_config_for
from splitserve.cluster.frontend.metrics import RouterViewCollector
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.engine_stats import STATS


def _samples(text: bytes, prefix: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def _poll(stats) -> PollReply:
    reply = PollReply([], stats, 0, 1, TransferTotals())
    return PollReply.from_bytes(reply.to_bytes())  # as the controller's probe receives it


def test_a_tiered_engines_stats_become_pool_series(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, block_size=16, num_kv_blocks=8, kv_offloading_size=0.001))
    prompt = [(7 * i) % 300 + 50 for i in range(70)]
    greedy = SamplingParams(temperature=0, max_tokens=1)
    for ids in (prompt, [(3 * i) % 300 + 9 for i in range(120)], prompt):  # the last one loads from host
        engine.generate([ids], greedy)
    stats = engine.stats()
    assert stats.host_loaded_blocks == 4 and stats.host_hit_tokens == 64
    metrics = PoolMetrics("tiny")
    metrics.observe_poll("prefill", "p0", _poll(stats))
    metrics.observe_poll("prefill", "p0", _poll(stats))  # cumulative stats: counted once
    got = _samples(metrics.render(), "splitserve_kv_")
    pool = (("pool", "prefill"),)
    assert got[("splitserve_kv_host_stored_blocks_total", pool)] == stats.host_stored_blocks > 0
    assert got[("splitserve_kv_host_loaded_blocks_total", pool)] == 4
    assert got[("splitserve_kv_host_loads_total", pool)] == 1
    assert got[("splitserve_kv_host_load_seconds_total", pool)] == pytest.approx(stats.host_load_seconds)
    by_tier = {
        t: got[("splitserve_kv_prompt_tokens_by_tier_total", (("pool", "prefill"), ("tier", t)))]
        for t in ("device", "host", "computed")
    }
    assert by_tier["host"] == 64 and by_tier["device"] == stats.num_prefix_hit_tokens - 64
    assert by_tier["computed"] == stats.num_computed_prompt_tokens
    usage = got[("splitserve_kv_host_block_usage", (("pool", "prefill"), ("replica", "p0")))]
    assert usage == stats.host_num_used_blocks / stats.host_num_blocks > 0
    metrics.forget_replica("prefill", "p0")
    assert not [k for k in _samples(metrics.render(), "splitserve_kv_host_block_usage")]
    # A replica without the tier exports none of it.
    plain = PoolMetrics("tiny")
    plain.observe_poll("decode", "d0", _poll(STATS))
    assert _samples(plain.render(), "splitserve_kv_host") == {}


def test_indexed_blocks_gauge_splits_by_tier_only_with_the_tier():
    def render(host):
        registry = CollectorRegistry()
        registry.register(RouterViewCollector("tiny", "a", lambda: {"prefill": 5, "decode": 2}, host))
        from prometheus_client import generate_latest

        return _samples(generate_latest(registry), "splitserve_router_indexed_blocks")

    assert render(None) == {
        ("splitserve_router_indexed_blocks", (("ingress", "a"), ("pool", p))): n
        for p, n in (("prefill", 5), ("decode", 2))
    }
    tiered = render(lambda: {"prefill": 7, "decode": 0})
    assert (
        tiered[("splitserve_router_indexed_blocks", (("ingress", "a"), ("pool", "prefill"), ("tier", "device")))] == 5
    )
    assert tiered[("splitserve_router_indexed_blocks", (("ingress", "a"), ("pool", "prefill"), ("tier", "host")))] == 7
    assert len(tiered) == 4


def test_kv_offloading_size_reaches_both_pools_and_rejects_negatives():
    cfg = ServeConfig(kv_offloading_size=0.5)
    for pool in (cfg.prefill, cfg.decode):
        assert EngineConfig(**engine_config_for(cfg, pool, "m")).kv_offloading_size == 0.5
    assert EngineConfig(**engine_config_for(ServeConfig(), cfg.decode, "m")).kv_offloading_size == 0
    with pytest.raises(ValueError, match="kv_offloading_size"):
        ServeConfig(kv_offloading_size=-1)
