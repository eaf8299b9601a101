"""Engine step timing metrics: a real engine's step timing crosses the poll wire and becomes
the pool's series (steps, forward seconds, host seconds, exposed host seconds, overlap), and
the async_scheduling setting reaches the engines."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.pool_metrics import PoolMetrics
from splitserve.cluster.control.worker_pool import engine_config_for
from splitserve.engine.config import EngineConfig, async_scheduling_pays
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
from splitserve.proto.messages.sampling_params import SamplingParams


def _samples(text: bytes) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels["pool"]): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name.startswith("splitserve_engine_")
    }


def _poll(stats) -> PollReply:
    return PollReply.from_bytes(PollReply([], stats, 0, 1, TransferTotals()).to_bytes())


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_engines_step_timing_becomes_pool_series(tiny_model, async_scheduling):
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32, async_scheduling=async_scheduling))
    engine.generate(
        [[5 + i for i in range(9)], [40 + i for i in range(5)]], SamplingParams(temperature=0, max_tokens=6)
    )
    stats = engine.stats()
    assert stats.async_scheduling is async_scheduling
    assert stats.num_timed_steps >= 6 and stats.step_forward_seconds > 0 and stats.step_host_seconds > 0
    metrics = PoolMetrics("tiny")
    metrics.observe_poll("decode", "d0", _poll(stats))
    metrics.observe_poll("decode", "d0", _poll(stats))  # cumulative stats: counted once
    got = _samples(metrics.render())
    assert got[("splitserve_engine_steps_total", "decode")] == stats.num_timed_steps
    assert got[("splitserve_engine_forward_seconds_total", "decode")] == pytest.approx(stats.step_forward_seconds)
    assert got[("splitserve_engine_host_seconds_total", "decode")] == pytest.approx(stats.step_host_seconds)
    exposed = got[("splitserve_engine_exposed_host_seconds_total", "decode")]
    assert exposed == pytest.approx(stats.step_exposed_host_seconds)
    overlap = got[("splitserve_engine_host_overlap", "decode")]
    assert overlap == pytest.approx(max(0.0, 1 - exposed / stats.step_host_seconds))
    if not async_scheduling:  # every gap between forwards is host work, and nothing else is
        assert overlap == pytest.approx(0.0, abs=0.05)


def test_the_switch_reaches_the_engines(tmp_path):
    for value in (True, False, None):
        cfg = ServeConfig(async_scheduling=value)
        for pool in (cfg.prefill, cfg.decode):
            engine_config = EngineConfig(**engine_config_for(cfg, pool, str(tmp_path)))
            # Unset on CPU: the decode engine decides once its model is loaded (where its decode
            # steps are scripted); a prefill replica's prompt chunks run eagerly, synchronously.
            unset = False if pool is cfg.prefill else None
            assert engine_config_for(cfg, pool, str(tmp_path))["async_scheduling"] is (
                unset if value is None else value
            )
            assert engine_config.async_scheduling is (unset if value is None else value)


def test_unset_async_scheduling_is_on_for_a_scripted_cpu_decode_only(tiny_model, monkeypatch):
    assert ServeConfig().async_scheduling is None
    # CUDA: unset until the engine decides, and an eager forward (no CUDA graphs) steps
    # synchronously (the H200 measured the overlap slower: bench/results/gpu_check.md).
    assert EngineConfig(model=tiny_model, device="cuda").async_scheduling is None
    assert async_scheduling_pays(scripted_decode=False) is False
    assert EngineConfig(model=tiny_model, device="cuda:1", async_scheduling=False).async_scheduling is False
    assert EngineConfig(model=tiny_model, device="cpu", async_scheduling=True).async_scheduling is True
    assert EngineConfig(model=tiny_model, device="cpu").async_scheduling is None  # the engine decides
    # fp32, unquantized: the decode step is one TorchScript call (engine/model/scripted_decode.py).
    cpu = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32))
    assert cpu.runner.scripted_decode is not None
    assert cpu.config.async_scheduling is True and cpu.pipeline is not None and cpu.stats().async_scheduling
    # An eager decode forward (quantized weights or KV, bf16, the switch) steps synchronously.
    for kw in ({"quantization": "int8"}, {"kv_cache_dtype": "fp8"}, {"dtype": "bfloat16"}):
        eager = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32, **kw))
        assert eager.config.async_scheduling is False and eager.pipeline is None, kw
    monkeypatch.setenv("SPLITSERVE_CPU_DECODE_FORWARD", "eager")
    eager = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32))
    assert eager.runner.scripted_decode is None and eager.pipeline is None
