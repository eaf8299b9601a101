"""Mixture-of-experts models (engine/model/moe.py) written by transformers: the router picks
transformers' experts (ties included), and the model computes its logits and greedy tokens;
what the MoE path does not run is refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

from splitserve.engine.builtin_models.model_spec import MakeModelError, ModelSpec
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model import moe as moe_module
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.loader import load_model
from splitserve.engine.model.moe import route
from splitserve.engine.model_config import ModelConfig
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import greedy_generate, make_checkpoint
from tests.helpers.transformers_checkpoint import PARITY_SHAPE, hf_greedy, model_logits, write_transformers_checkpoint

pytestmark = pytest.mark.unit

SHAPE = dict(PARITY_SHAPE, head_dim=16)
MIXTRAL = dict(**SHAPE, num_local_experts=4, num_experts_per_tok=2)


def _prompt(length: int) -> list[int]:
    return torch.randint(0, SHAPE["vocab_size"], (length,), generator=torch.Generator().manual_seed(7)).tolist()


def test_the_router_picks_transformers_experts_ties_included():
    config = transformers.MixtralConfig(**MIXTRAL)
    router = MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(32, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(3))
    _, hf_weights, hf_experts = router(x)
    weights, experts = route(torch.nn.functional.linear(x, router.weight), 2, renormalise=True)
    assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)
    # Ties: experts 0 and 1, and 2 and 3, share router rows, so every token's logits tie in
    # pairs. Both routers call torch.topk on the same float32 probabilities, so ties break
    # the same way: as torch.topk breaks them, which is not "lowest id first" (on CPU, four
    # equal logits give experts [2, 3]).
    with torch.no_grad():
        router.weight[1] = router.weight[0]
        router.weight[3] = router.weight[2]
    _, hf_weights, hf_experts = router(x)
    weights, experts = route(torch.nn.functional.linear(x, router.weight), 2, renormalise=True)
    assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)
    assert torch.equal(weights, torch.full((32, 2), 0.5))  # each token's top two are a tied pair
    hf_router_topk = torch.topk(torch.softmax(torch.zeros(1, 4), -1), 2).indices
    assert route(torch.zeros(1, 4), 2, renormalise=True)[1].tolist() == hf_router_topk.tolist()


def test_each_expert_computes_only_the_tokens_routed_to_it(tmp_path, monkeypatch):
    write_transformers_checkpoint(transformers.MixtralConfig(**MIXTRAL), tmp_path, seed=1)
    model, _ = load_model(tmp_path)
    moe = model.layers[0].moe
    seen: list[int] = []
    real_linear = moe_module.linear

    def counting_linear(x, weight, bias=None):
        if tuple(weight.shape) == (2 * moe.inter, moe.hidden):
            seen.append(x.shape[0])
        return real_linear(x, weight, bias)

    monkeypatch.setattr(moe_module, "linear", counting_linear)
    moe(torch.randn(10, SHAPE["hidden_size"]), torch.nn.functional.silu)
    assert sum(seen) == 10 * 2 and len(seen) <= 4  # 2 experts per token, one matmul per expert used


@pytest.mark.parametrize("case", ["mixtral", "mixtral-top1"])
def test_a_mixtral_checkpoint_matches_transformers(tmp_path, case):
    top_k = 1 if case.endswith("top1") else 2
    hf = write_transformers_checkpoint(
        transformers.MixtralConfig(**{**MIXTRAL, "num_experts_per_tok": top_k}), tmp_path, seed=len(case)
    )
    model, config = load_model(tmp_path)
    assert config.architecture == "MixtralForCausalLM" and config.num_experts == 4
    assert config.num_experts_per_tok == top_k and config.moe_layers == [0, 1]
    assert model.use_scripted_decode()  # decode steps run the scripted graph, experts included
    ids = _prompt(40)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model_logits(model, ids), expected, atol=1e-4, rtol=0)
    assert greedy_generate(model, ids, 12) == hf_greedy(hf, ids, 12)


QWEN3_MOE = dict(
    **{**SHAPE, "num_hidden_layers": 3},
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,  # the experts' own size; the dense layers' is intermediate_size
)
QWEN3_MOE_CONFIGS = {
    # A dense layer (mlp_only_layers) between two sparse ones, k weights renormalised.
    "qwen3-moe-mlp-only": (dict(mlp_only_layers=[1], norm_topk_prob=True), [0, 2]),
    # Every second layer sparse, the k weights as the softmax gave them (transformers' default).
    "qwen3-moe-step2": (dict(decoder_sparse_step=2, norm_topk_prob=False), [1]),
}


@pytest.mark.parametrize("case", list(QWEN3_MOE_CONFIGS))
def test_a_qwen3_moe_checkpoint_matches_transformers(tmp_path, case):
    change, sparse = QWEN3_MOE_CONFIGS[case]
    hf = write_transformers_checkpoint(transformers.Qwen3MoeConfig(**QWEN3_MOE, **change), tmp_path, seed=len(case))
    model, config = load_model(tmp_path)
    assert config.architecture == "Qwen3MoeForCausalLM" and config.qk_norm
    assert config.moe_layers == sparse and config.norm_topk_prob == change["norm_topk_prob"]
    assert [layer.moe is not None for layer in model.layers] == [i in sparse for i in range(3)]
    ids = _prompt(40)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model_logits(model, ids), expected, atol=1e-4, rtol=0)
    assert greedy_generate(model, ids, 12) == hf_greedy(hf, ids, 12)


@pytest.mark.parametrize(("arch", "sparse"), [("mixtral", [0, 1]), ("qwen3_moe", [0])])
def test_make_model_writes_a_moe_checkpoint_that_transformers_computes_alike(tmp_path, arch, sparse):
    path = make_checkpoint(tmp_path, "tiny", arch)
    model, config = load_model(path)
    assert config.num_experts == 4 and config.moe_layers == sparse  # qwen3_moe: its last layer dense
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = _prompt(24)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model_logits(model, ids), expected, atol=1e-4, rtol=0)
    assert greedy_generate(model, ids, 8) == hf_greedy(hf, ids, 8)


def test_what_the_moe_path_does_not_run_is_refused_by_name():
    raw = {**MIXTRAL, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    config = ModelConfig.from_dict(raw)
    prequantized = dataclasses.replace(config, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ConfigError, match="MixtralForCausalLM .mixture of experts. from a pre-quantized checkpoint"):
        LlamaForCausalLM(prequantized)
    with pytest.raises(ConfigError, match="num_experts_per_tok must be in 1..4"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": 5})
    with pytest.raises(MakeModelError, match="--train-steps is not supported for qwen3_moe"):
        ModelSpec(arch="qwen3_moe", train_steps=10)


def test_an_engine_serves_a_mixtral_checkpoint_as_the_model_computes_it(tmp_path):
    """The whole engine (batched prefill and decode, the eager decode step, packed weights
    where the platform packs them) gives the model's own greedy tokens for two prompts."""
    path = make_checkpoint(tmp_path, "tiny", "mixtral")
    prompts = [_prompt(20), _prompt(9)]
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    model, _ = load_model(path)
    assert [out.token_ids for out in outputs] == [greedy_generate(model, ids, 10) for ids in prompts]


def test_an_engine_serves_a_mixture_of_experts_quantized_as_it_loads(tmp_path):
    """--quantization int4 on Qwen3-MoE (sparse and dense layers): the experts and the dense
    MLP become int4 weights; the engine gives the quantized model's own greedy tokens and
    returns every block."""
    path = make_checkpoint(tmp_path, "tiny", "qwen3_moe")
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64, quantization="int4"))
    sparse, dense = engine.model.layers[0], engine.model.layers[1]
    assert type(sparse.moe.experts[0].down_weight).__name__ == type(dense.down_weight).__name__ == "Int4Weight"
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    (out,) = engine.generate([_prompt(20)], params)
    model, _ = load_model(path, quantization="int4")
    assert list(out.token_ids) == greedy_generate(model, _prompt(20), 10)
    assert engine.kv.num_free_blocks == 64


def test_the_stacked_experts_compute_what_the_per_expert_loop_computes(tmp_path, monkeypatch):
    """forward_stacked (CUDA's path for many experts: two padded bmm) against forward's loop on
    the same layer and tokens, with a skewed routing (some experts get none); stacking makes
    each expert's parameters views of the stack, so the weights are held once."""
    hf = write_transformers_checkpoint(
        transformers.Qwen3MoeConfig(**{**QWEN3_MOE, "num_experts": 6, "num_experts_per_tok": 3}), tmp_path, seed=3
    )
    del hf
    monkeypatch.setenv("SPLITSERVE_CPU_MATMUL", "blas")  # plain weights, as on CUDA (not oneDNN-packed)
    model, _ = load_model(tmp_path)
    moe = model.layers[0].moe
    x = torch.randn(9, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(4))
    x[:5] = x[0]  # five tokens route alike: the padded batch has unequal runs
    with torch.inference_mode():
        looped = moe(x, torch.nn.functional.silu)
        assert not moe._stacked  # CPU runs the loop
        stacked = moe.forward_stacked(x, torch.nn.functional.silu)
    torch.testing.assert_close(stacked, looped, atol=1e-5, rtol=1e-5)
    gate_up, down = moe.stacked_weights()
    assert moe.experts[2].gate_up_weight.data_ptr() == gate_up.transpose(1, 2)[2].data_ptr()
    assert moe.experts[5].down_weight.untyped_storage().data_ptr() == down.untyped_storage().data_ptr()
    with torch.inference_mode():
        torch.testing.assert_close(moe(x, torch.nn.functional.silu), looped, atol=0, rtol=0)  # views: same weights


def test_quantized_or_packed_experts_are_never_stacked(tmp_path):
    path = make_checkpoint(tmp_path, "tiny", "qwen3_moe")
    for quantization in ("int8", "none"):  # "none" on CPU: oneDNN-packed
        model, _ = load_model(path, quantization=quantization)
        assert not model.layers[0].moe._plain_weights(), quantization
