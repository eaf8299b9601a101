"""SimulatedEngine on its own: deterministic tokens that respect max_tokens and stop tokens,
the real prefix cache and KV events, the step-time profile followed within a stated tolerance
(at speed factor 1 and slowed), the layer callbacks of a forward, and clear errors."""

from __future__ import annotations

import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.worker_pool import engine_config_for
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.engine_factory import build_engine
from splitserve.engine.engine_protocol import EngineProtocol
from splitserve.engine.simulated.simulated_engine import SimulatedEngine
from splitserve.engine.simulated.step_time_profile import KVLinkProfile, StepTimeProfile
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

PROMPT = list(range(20, 84))  # four full blocks
# Tolerance of the timing tests: the median measured step is within 25% (+ 5 ms of timer
# slack) of the profile's prediction, and no step is shorter than predicted. The wait *is* the
# model, so only the sleep's overshoot on a busy machine can widen it.


def simulated(model: str, **kw) -> SimulatedEngine:
    engine = build_engine(EngineConfig(model=model, engine="simulated", profile="llama-8b-h200", **kw))
    assert isinstance(engine, SimulatedEngine) and isinstance(engine, EngineProtocol)
    return engine


def test_tokens_are_deterministic_and_respect_max_tokens_and_stop_tokens(tiny_model):
    a, b, other_seed = simulated(tiny_model), simulated(tiny_model), simulated(tiny_model, seed=1)
    params = SamplingParams(max_tokens=16)
    [first] = a.generate([PROMPT], params)
    assert first.finish_reason == "length" and len(first.token_ids) == 16
    assert b.generate([PROMPT], params)[0].token_ids == first.token_ids  # another replica, same "model"
    assert other_seed.generate([PROMPT], params)[0].token_ids != first.token_ids
    assert not set(first.token_ids) & set(a.eos_token_ids)
    stop = first.token_ids[5]
    [stopped] = a.generate([PROMPT], SamplingParams(max_tokens=16, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop" and stopped.token_ids == first.token_ids[: first.token_ids.index(stop) + 1]


def test_prefix_cache_and_kv_events_are_the_real_ones(tiny_model):
    engine = simulated(tiny_model)
    engine.generate([PROMPT], SamplingParams(max_tokens=2))
    stored = [h for e in engine.take_events() if e.kind == "stored" for h in e.block_hashes]
    assert len(stored) >= 4
    [again] = engine.generate([PROMPT + [7, 8]], SamplingParams(max_tokens=2))
    assert again.num_cached_tokens == 64
    assert engine.stats().num_free_blocks == engine.stats().num_blocks  # every block back


@pytest.mark.parametrize("speed_factor", [1.0, 4.0])
def test_step_durations_follow_the_profile(tiny_model, tmp_path, speed_factor):
    profile = StepTimeProfile(
        name="test",
        step_overhead_s=0.02,
        token_compute_s=0.0002,
        context_token_s=0.00001,
        kv_link=KVLinkProfile(bytes_per_s=1e9),
    )
    profile.dump(tmp_path / "p.yaml")
    engine = build_engine(
        EngineConfig(model=tiny_model, engine="simulated", profile=str(tmp_path / "p.yaml"), speed_factor=speed_factor)
    )
    engine.generate([PROMPT, PROMPT[::-1], PROMPT[:40]], SamplingParams(max_tokens=8))
    steps = list(engine.runner.step_times)
    assert len(steps) >= 8
    # Predicted wall time = the profile's step time x speed_factor, computed per step; a step
    # lasts at least that (how little more is the machine's business: a busy one oversleeps).
    assert all(measured >= predicted for predicted, measured in steps)
    # The first step prefills 64 + 64 + 40 tokens: 20 ms + 168 x 0.2 ms + 168 x 0.01 ms.
    assert steps[0][0] == pytest.approx((0.02 + 168 * 0.0002 + 168 * 0.00001) * speed_factor)
    assert engine.simulated_seconds == pytest.approx(sum(p for p, _ in steps) / speed_factor)


def test_a_step_calls_the_layer_callback_once_per_layer(tiny_model):
    engine = simulated(tiny_model)
    layers = []
    engine.add_sequence(engine.make_sequence(None, PROMPT, SamplingParams(max_tokens=1)))
    engine.step(lambda batch: layers.append)
    while engine.has_unfinished():  # async scheduling: the forward is taken in by a later step
        engine.step(lambda batch: layers.append)
    assert layers == list(range(engine.model_config.num_hidden_layers))


def test_unsimulated_features_and_bad_profiles_are_clear_errors(tiny_model, tmp_path):
    engine = simulated(tiny_model)
    with pytest.raises(InvalidRequestError, match="not simulated"):
        engine.make_sequence(
            None, PROMPT, SamplingParams(structured_output=GrammarSpec.json_schema({"type": "object"}))
        )
    with pytest.raises(InvalidRequestError, match="not simulated"):
        engine.make_sequence(None, PROMPT, SamplingParams(prompt_logprobs=0))
    with pytest.raises(ConfigError, match="neither a file nor a shipped one"):
        StepTimeProfile.load("no-such-profile")
    (tmp_path / "bad.yaml").write_text("name: x\nstep_overhead_s: -1\ntoken_compute_s: 0\nkv_link: {bytes_per_s: 1}\n")
    with pytest.raises(ConfigError, match="step_overhead_s"):
        StepTimeProfile.load(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match="engine must be one of"):
        EngineConfig(model=tiny_model, engine="fake")
    with pytest.raises(ValueError, match="engine_profile"):
        ServeConfig(engine="simulated", engine_profile="no-such-profile")


def test_serve_config_picks_each_pools_engine():
    cfg = ServeConfig.model_validate(
        {
            "engine": "simulated",
            "speed_factor": 5,
            "engine_profile": "llama-70b-h200",
            "prefill": {"engine": "real"},
            "decode": {"tensor_parallel_size": 8},  # the profile's replicas: 8 GPUs
        }
    )
    prefill, decode = engine_config_for(cfg, cfg.prefill, "m"), engine_config_for(cfg, cfg.decode, "m")
    assert (prefill["engine"], decode["engine"]) == ("real", "simulated")
    assert decode["profile"] == "llama-70b-h200" and decode["speed_factor"] == 5
    for name in StepTimeProfile.shipped():  # every shipped profile loads
        assert StepTimeProfile.load(name).name == name


def test_a_tensor_parallel_replica_steps_by_its_sizes_figures(tiny_model):
    """TP 2 on llama-8b-h200: the step is the profile's TP-2 figures (half the weight reads,
    compute and KV reads of TP 1, the all-reduces added), the tokens those of TP 1."""
    tp1, tp2 = simulated(tiny_model), simulated(tiny_model, tensor_parallel_size=2)
    params = SamplingParams(max_tokens=4)
    assert tp2.generate([PROMPT], params)[0].token_ids == tp1.generate([PROMPT], params)[0].token_ids
    figures = StepTimeProfile.load("llama-8b-h200").tensor_parallel[2]
    assert (tp2.profile.tensor_parallel_size, tp2.profile.weight_read_s) == (2, figures.weight_read_s)
    prefill = tp2.runner.step_times[0][0]  # 64 prompt tokens, computed from scratch
    assert prefill == pytest.approx(
        figures.step_overhead_s
        + max(figures.weight_read_s, 64 * figures.token_compute_s)
        + 64 * figures.context_token_s
    )
    assert prefill < tp1.runner.step_times[0][0]


def test_a_tensor_parallel_size_the_profile_lacks_is_a_clear_error(tiny_model):
    with pytest.raises(ConfigError, match=r"no figures for tensor_parallel_size 8 \(it has 1, 2, 4\)"):
        simulated(tiny_model, tensor_parallel_size=8)
    with pytest.raises(ValueError, match="engine_profile: .*'cpu-fitted' has no figures for tensor_parallel_size 2"):
        ServeConfig.model_validate({"engine": "simulated", "decode": {"tensor_parallel_size": 2}})
    with pytest.raises(ValueError, match="'llama-70b-h200' has no figures for tensor_parallel_size 1"):
        ServeConfig.model_validate({"engine": "simulated", "engine_profile": "llama-70b-h200"})
