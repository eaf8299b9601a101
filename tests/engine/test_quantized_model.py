"""Quantized loading of whole models: layer by layer, what stays in full precision, bad values."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from safetensors.torch import save_file

import splitserve.engine.model.llama as llama_module
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.model.checkpoint import CheckpointError, iterate_weights
from splitserve.engine.model.loader import load_model
from splitserve.engine.quant.quantize import WEIGHT_CLASSES, weight_bytes
from tests.helpers.heap import heap_bytes_in_use
from tests.helpers.model import contiguous_metadata, make_checkpoint, make_kv_cache

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 512, 1024, 16, 256


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A 16-layer checkpoint whose matmul weights (~150 MB in fp32) dwarf everything else."""
    root = tmp_path_factory.mktemp("wide")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }
    (root / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.02}
    tensors["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g) * 0.02
    tensors["model.norm.weight"] = torch.ones(HIDDEN)
    shapes = {
        "self_attn.q_proj": (512, HIDDEN),
        "self_attn.k_proj": (256, HIDDEN),
        "self_attn.v_proj": (256, HIDDEN),
        "self_attn.o_proj": (HIDDEN, 512),
        "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTERMEDIATE),
    }
    for i in range(LAYERS):
        for name, shape in shapes.items():
            tensors[f"model.layers.{i}.{name}.weight"] = torch.randn(shape, generator=g) * 0.02
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(HIDDEN)
    linear_bytes = sum(4 * h * w for h, w in shapes.values()) * LAYERS
    save_file(tensors, str(root / "model.safetensors"))
    return root, linear_bytes


def _peak_heap_growth_while_loading(model_dir, monkeypatch, quantization: str) -> tuple[int, torch.nn.Module]:
    """Load, sampling the C heap at every tensor the checkpoint yields; -> (peak growth, model)."""
    gc.collect()
    baseline = heap_bytes_in_use()
    peak = [0]

    def sampled(path):
        for item in iterate_weights(path):
            peak[0] = max(peak[0], heap_bytes_in_use() - baseline)
            yield item
        peak[0] = max(peak[0], heap_bytes_in_use() - baseline)

    monkeypatch.setattr("splitserve.engine.model.loader.iterate_weights", sampled)
    model, _ = load_model(model_dir, quantization=quantization)
    return peak[0], model


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_load_never_holds_the_full_precision_model(wide_model, monkeypatch, scheme):
    model_dir, linear_bytes = wide_model
    peak, model = _peak_heap_growth_while_loading(model_dir, monkeypatch, scheme)
    one_layer = linear_bytes // LAYERS
    assert model.quantizer.peak_full_precision_bytes <= one_layer
    # The quantized model (1/4 or 1/8 of fp32) plus about a layer in flight: far below the
    # full-precision matmul weights, which an unquantized load does hold (checked below).
    assert peak < 0.5 * linear_bytes, (peak, linear_bytes)
    quantized = sum(weight_bytes(layer) for layer in model.layers)
    assert quantized < (0.3 if scheme == "int8" else 0.2) * linear_bytes
    del model
    gc.collect()
    peak_full, full_model = _peak_heap_growth_while_loading(model_dir, monkeypatch, "none")
    assert peak_full > 0.95 * linear_bytes  # the measurement sees the memory a load holds


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_only_decoder_matmuls_are_quantized(tmp_path_factory, scheme):
    model_dir = make_checkpoint(tmp_path_factory.getbasetemp(), "tiny", "qwen2")  # tied embeddings, qkv bias
    model, _ = load_model(model_dir, quantization=scheme)
    for layer in model.layers:
        for attr in layer.LINEAR_WEIGHTS:
            assert isinstance(getattr(layer, attr), WEIGHT_CLASSES[scheme])
        assert layer.qkv_bias.dtype == torch.float32 and layer.input_norm.dtype == torch.float32
    assert model.embed_tokens.dtype == model.lm_head.dtype == model.final_norm.dtype == torch.float32
    assert not any(p.is_meta for p in model.parameters())


def test_quantized_model_tracks_full_precision_hidden_states(tmp_path_factory):
    model_dir = make_checkpoint(tmp_path_factory.getbasetemp(), "tiny", "llama")
    full, _ = load_model(model_dir)
    hidden_full = _last_hidden(full)
    errors = {}
    # Random weights amplify errors through the layers (measured 0.034, 0.15, 0.37): loose
    # bounds; quality on a trained model is tests/engine/test_quantization_quality.py's.
    for scheme, bound in (("int8", 0.07), ("fp8", 0.3), ("int4", 0.7)):
        quantized, _ = load_model(model_dir, quantization=scheme)
        errors[scheme] = float((_last_hidden(quantized) - hidden_full).norm() / hidden_full.norm())
        assert errors[scheme] < bound, (scheme, errors)
    assert errors["int8"] < errors["fp8"] < errors["int4"]  # 8 bits of precision, 4 of mantissa, 4 bits


def _last_hidden(model) -> torch.Tensor:
    """Final hidden states of one 32-token prompt (random weights: a numeric, not a quality, check)."""
    cache, blocks_per_seq = make_kv_cache(model, 32)
    meta = contiguous_metadata([32], [32], block_size=16, blocks_per_seq=blocks_per_seq)
    return model(torch.arange(1, 33), torch.arange(32), cache, meta)


def test_bad_quantization_values_are_clear_errors(tmp_path_factory):
    model_dir = make_checkpoint(tmp_path_factory.getbasetemp(), "tiny", "llama")
    with pytest.raises(CheckpointError, match="quantization must be one of none, int8, fp8, int4, got 'int3'"):
        load_model(model_dir, quantization="int3")
    with pytest.raises(ConfigError, match="quantization must be one of none, int8, fp8, int4, got 'fp4'"):
        EngineConfig(model=str(model_dir), quantization="fp4")


def test_a_duplicated_quantized_weight_is_rejected(tmp_path_factory):
    model_dir = make_checkpoint(tmp_path_factory.getbasetemp(), "tiny", "llama")
    weights = list(iterate_weights(model_dir))
    model = llama_module.LlamaForCausalLM(load_model(model_dir)[1], quantization="int8")
    with pytest.raises(CheckpointError, match="appears twice"):
        model.load_weights(weights + weights[-1:])


def test_the_draft_model_is_quantized_too_and_greedy_output_is_unchanged(tmp_path_factory):
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.proto.messages.sampling_params import SamplingParams

    model_dir = str(make_checkpoint(tmp_path_factory.getbasetemp(), "tiny", "llama"))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, list(range(3, 40))]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=128, quantization="int8")).generate(prompts, greedy)
    spec = {"method": "draft", "draft_model": model_dir, "policy": "fixed", "num_speculative_tokens": 4}
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=128, quantization="int8", speculative=spec))
    draft = engine.speculator.draft_proposer.model
    assert all(isinstance(layer.qkv_weight, WEIGHT_CLASSES["int8"]) for layer in draft.layers)
    outs = engine.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = engine.stats()
    # The draft is the target, quantized alike: (nearly) every draft token is accepted.
    assert stats.spec_proposed_tokens > 20 and stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks


def test_generate_cli_takes_quantization(tmp_path_factory, capsys):
    from splitserve.cluster.cli.main import main
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.proto.messages.sampling_params import SamplingParams

    model_dir = str(make_checkpoint(tmp_path_factory.getbasetemp(), "tiny", "llama"))
    argv = ["generate", "--model", model_dir, "--prompt-token-ids", "5,6,7,8", "--max-tokens", "8"]
    assert main([*argv, "--temperature", "0", "--ignore-eos", "--json", "--quantization", "int4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    engine = LLMEngine(EngineConfig(model=model_dir, quantization="int4"))
    expected = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert printed["token_ids"] == expected.token_ids
    with pytest.raises(SystemExit):  # argparse: invalid choice
        main([*argv, "--quantization", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
