"""LoRA adapter tier metrics: a real engine serving four adapters on one device slot and a host
cache of two reports its loads and evictions by tier; its stats cross the poll wire and become
the pool's series (splitserve_lora_loads_total, splitserve_lora_evictions_total, the
splitserve_lora_load_seconds histogram), each load counted and timed once however often the
controller probes."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from tests.engine import test_lora
from tests.engine.test_lora import ADAPTERS, PROMPTS, greedy
from tests.helpers.peft_adapters import lora_engine

checkpoint = test_lora.checkpoint
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name.startswith("splitserve_lora_")
    }


def _poll(stats) -> PollReply:
    reply = PollReply([], stats, 0, 1, TransferTotals())
    return PollReply.from_bytes(reply.to_bytes())  # as the controller's probe receives it


def test_adapter_loads_and_evictions_become_pool_series_by_tier(checkpoint):
    engine = lora_engine(checkpoint, max_loras=1, max_cpu_loras=2)
    metrics = PoolMetrics("tiny")
    for name in ADAPTERS:
        engine.generate([PROMPTS[0]], greedy(name, max_tokens=2))
    first = engine.stats()
    metrics.observe_poll("decode", "d0", _poll(first))
    metrics.observe_poll("decode", "d0", _poll(first))  # cumulative stats: counted once
    engine.generate([PROMPTS[0]], greedy("attn", max_tokens=2))  # evicted from both tiers: loaded again
    stats = engine.stats()
    assert stats.lora_loads["device"] == first.lora_loads["device"] + 1 == 5  # 1 at start, then 4
    assert stats.lora_loads["host"] == first.lora_loads["host"] + 1 == 7  # 4 at start, 2 misses, 1
    metrics.observe_poll("decode", "d0", _poll(stats))
    got = _samples(metrics.render())
    for tier in ("device", "host"):
        labels = (("pool", "decode"), ("tier", tier))
        assert got[("splitserve_lora_loads_total", labels)] == stats.lora_loads[tier]
        assert got[("splitserve_lora_evictions_total", labels)] == stats.lora_evictions[tier] > 0
        # Every load timed once, the one after the second probe too.
        assert got[("splitserve_lora_load_seconds_count", labels)] == stats.lora_loads[tier]
        assert got[("splitserve_lora_load_seconds_sum", labels)] > 0
    assert stats.lora_device_adapters == ["attn"] and stats.lora_host_adapters == ["attn", "qv"]
    metrics.forget_replica("decode", "d0")
    assert not metrics.lora._last
