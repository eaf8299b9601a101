"""Mixtures of experts under tensor parallelism (engine level, two gloo ranks, no Ray): every
rank holds its slice of every expert's intermediate dimension and the whole router, and TP=2
gives TP=1's greedy tokens and log-probabilities on Mixtral and on Qwen3-MoE (sparse and dense
layers). Correctness only, no timing."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.engine.config import ConfigError
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.parallel.shard_plan import ShardPlan, check_tensor_parallel_size
from tests.engine.test_tensor_parallel import _assert_same, _config, _greedy
from tests.helpers.model import make_checkpoint


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_tp2_greedy_equals_tp1_on_a_mixture_of_experts(models_root, arch):
    model = str(make_checkpoint(models_root, "tiny", arch))
    reference = _greedy(LLMEngine(_config(model, 1)))
    engine = LLMEngine(_config(model, 2))
    try:
        moe = engine.model.shard.layers[0].moe
        whole = ModelConfig.from_pretrained(model).moe_intermediate_size
        assert moe.inter == whole // 2 and moe.router_weight.shape[0] == moe.num_experts  # router whole
        _assert_same(reference, _greedy(engine))
    finally:
        engine.close()


def test_every_rank_reads_its_slice_of_every_expert(models_root):
    config = ModelConfig.from_pretrained(make_checkpoint(models_root, "tiny", "mixtral"))  # experts 128 wide
    layer = "model.layers.1.block_sparse_moe."
    for rank in range(2):
        plan = ShardPlan(config, 2, rank)
        rows = (0, 64 * rank, 64 * (rank + 1))
        for expert in range(config.num_experts):
            assert plan.checkpoint_slice(f"{layer}experts.{expert}.w1.weight") == rows  # gate
            assert plan.checkpoint_slice(f"{layer}experts.{expert}.w3.weight") == rows  # up
            assert plan.checkpoint_slice(f"{layer}experts.{expert}.w2.weight") == (1, *rows[1:])  # down
        assert plan.checkpoint_slice(f"{layer}gate.weight") is None
        assert plan.local_config.moe_intermediate_size == 64
    three_way = dataclasses.replace(config, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 does not divide moe_intermediate_size 128"):
        check_tensor_parallel_size(three_way, 3)  # heads and the dense width split by 3, the experts not
