"""Speculative decoding and the scripted CPU decode step under tensor parallelism.

Speculation works: the driver (rank 0) proposes -- n-gram lookup, or the draft model, which
runs whole on rank 0 with a KV cache of its own -- and the target model's verification forward
is mirrored on every rank like any forward. On the trained small model TP 2 with either method
gives TP 1's greedy tokens without speculation, having accepted drafted tokens.

The scripted CPU decode step (one TorchScript call) has no place for the collectives: a TP
engine runs the eager step, and naming the scripted one (SPLITSERVE_CPU_DECODE_FORWARD=scripted)
is a one-line start-up error instead of being ignored."""

from __future__ import annotations

import pytest

from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.engine.config import CPU_DECODE_FORWARD_ENV, ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.engine.test_worker_api import assert_baseline
from tests.helpers.cli import run_cli
from tests.helpers.model import READS_TRAINED_CHECKPOINT, make_checkpoint

PROMPTS = ["Hello, how are you today? Hello, how are you today? Hello, how", "The river runs"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _trained(preset: str) -> str:
    return str(cached_checkpoint(ModelSpec(preset, "llama", seed=0, train_steps=300)).path)


@pytest.mark.slow  # the trained models (about 100 s of CPU each where the shared cache lacks them)
@READS_TRAINED_CHECKPOINT
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tp2_speculative_greedy_equals_tp1(method):
    model = _trained("small")
    reference = LLMEngine(EngineConfig(model=model, num_kv_blocks=64)).generate(PROMPTS, GREEDY)
    speculative = {"method": method, "num_speculative_tokens": 3, "policy": "fixed"}  # not timing-dependent
    if method == "draft":
        speculative["draft_model"] = _trained("draft")
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=2, speculative=speculative))
    try:
        outputs = engine.generate(PROMPTS, GREEDY)
        stats = engine.stats()
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
        assert stats.spec_method == method and stats.spec_accepted_tokens > 0
        assert_baseline(engine)
    finally:
        engine.close()


REFUSAL = (
    "tensor_parallel_size 2 does not support the scripted CPU decode step "
    f"({CPU_DECODE_FORWARD_ENV}=scripted; unset it or set eager)"
)


def test_a_tp_engine_runs_the_eager_step_and_refuses_the_scripted_one_by_name(models_root, monkeypatch, capsys):
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)  # the CPU default: scripted where it can
    assert LLMEngine(EngineConfig(model=model, num_kv_blocks=64)).model._scripted_decode is not None
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=2))
    try:
        assert engine.model._scripted_decode is None and engine.model.shard._scripted_decode is None
    finally:
        engine.close()
    monkeypatch.setenv(CPU_DECODE_FORWARD_ENV, "scripted")
    with pytest.raises(ConfigError) as raised:
        LLMEngine(EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=2))
    assert str(raised.value) == REFUSAL
    result = run_cli(capsys, "generate", "--model", model, "--prompt", "hi", "--tensor-parallel-size", "2")
    assert result.returncode == 2 and result.stderr.strip() == f"splitserve generate: error: {REFUSAL}"
