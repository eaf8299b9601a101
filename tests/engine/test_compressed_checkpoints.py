"""Pre-quantized checkpoints written by the compressed-tensors library (what llm-compressor
saves through): FP8_DYNAMIC (float-quantized), W8A8 (int-quantized), W8A16 and W4A16 (sym and
asym; pack-quantized, GPTQ int32 packing). Each loads into the engine's quantized weights with
exactly the library's dequantized values, and the model's logits match transformers running
the library's decompressed checkpoint (activations quantized as the scheme says). Unsupported
schemes are a one-line error naming them, before Ray starts (the preflight)."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.cluster.cli.preflight import PreflightError, check_model
from splitserve.cluster.config import ServeConfig
from splitserve.engine.model.checkpoint import CheckpointError
from splitserve.engine.model.loader import load_model
from splitserve.engine.quant.quantize import WEIGHT_CLASSES
from tests.helpers.compressed_checkpoint import write_compressed_checkpoint
from tests.helpers.model import contiguous_metadata, make_checkpoint, make_kv_cache

PROMPT = list(range(5, 69))
# preset -> (our scheme, logits tolerance vs transformers on the library's weights). bf16
# activations (the CPU int8/int4 kernels') cost ~2% through this random model's 4 layers; the
# library's own weights and scales are loaded exactly (checked separately, to 1e-6).
PRESETS = {
    # fp8 per-token activations on both sides (measured 0.028: rounding ties flip and this random
    # model amplifies them; without the reference's activation quantization it is 0.18)
    "FP8_DYNAMIC": ("fp8", 0.06),
    "W8A8": ("int8", 0.05),  # run weight-only: activations in bf16, not int8
    "W8A16": ("int8", 1e-4),  # group scales: dequantized per call, fp32 GEMM
    "W4A16": ("int4", 0.05),
    "W4A16_ASYM": ("int4", 0.05),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.getbasetemp(), "small", "llama")


def _library_reference(checkpoint, preset: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """transformers on the library's decompressed weights, each Linear's input quantized as the
    scheme's input_activations say (the library's own dynamic scales and fake_quantize)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    if preset == "FP8_DYNAMIC":  # decompressed modules no longer carry their scheme: the preset's
        args = preset_name_to_scheme(preset, ["Linear"]).input_activations

        def hook(module, inputs):
            x = inputs[0]
            scale, zero_point = compute_dynamic_scales_and_zp(x, args, module)
            return (fake_quantize(x, scale, zero_point, args),)

        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.register_forward_pre_hook(hook)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return model, logits


def _our_logits(model) -> torch.Tensor:
    cache, blocks_per_seq = make_kv_cache(model, len(PROMPT))
    meta = contiguous_metadata([len(PROMPT)], [len(PROMPT)], 16, blocks_per_seq)
    return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache, meta))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_compressed_tensors_checkpoint_matches_the_library(source, tmp_path, preset):
    scheme, tolerance = PRESETS[preset]
    checkpoint = write_compressed_checkpoint(source, tmp_path / preset, preset)
    model, _ = load_model(checkpoint)
    assert model.quantization == scheme
    reference, ref_logits = _library_reference(checkpoint, preset)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.qkv_weight, WEIGHT_CLASSES[scheme])
        attn = reference.model.layers[i].self_attn
        library = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        ours = layer.qkv_weight.dequantize().detach()
        assert float((ours - library).abs().max() / library.abs().max()) < (
            8e-3 if scheme == "int4" else 1e-6
        )  # int4: bf16 scales (2^-8)
    logits = _our_logits(model)
    assert float((logits - ref_logits).norm() / ref_logits.norm()) < tolerance
    full = _our_logits(load_model(source)[0])  # quantization is visible: the check can fail
    assert float((full - ref_logits).norm() / ref_logits.norm()) > 2 * min(tolerance, 0.01)


def test_a_checkpoint_in_another_scheme_needs_no_flag_and_refuses_a_different_one(source, tmp_path):
    checkpoint = write_compressed_checkpoint(source, tmp_path / "w4", "W4A16")
    with pytest.raises(CheckpointError, match="quantized as int4 .*--quantization int8 disagrees"):
        load_model(checkpoint, quantization="int8")
    assert load_model(checkpoint, quantization="int4")[0].quantization == "int4"
    with pytest.raises(PreflightError, match="quantized as int4 .*--quantization fp8 disagrees"):
        check_model(ServeConfig(model=str(checkpoint), quantization="fp8"))


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"format": "nvfp4-pack-quantized"}, "compressed-tensors format 'nvfp4-pack-quantized' is not supported"),
        (
            {
                "config_groups": {
                    "g": {"weights": {"type": "int", "num_bits": 2, "strategy": "group", "group_size": 128}}
                }
            },
            "compressed-tensors pack-quantized int2 weights \\(group\\) are not supported",
        ),
    ],
)
def test_an_unsupported_scheme_is_a_one_line_preflight_error(source, tmp_path, patch, message):
    checkpoint = write_compressed_checkpoint(source, tmp_path / "ckpt", "W4A16")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"].update(patch)
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(PreflightError, match=message) as caught:
        check_model(ServeConfig(model=str(checkpoint)))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("block", [None, [128, 128]])
def test_hf_fp8_checkpoint_loads(source, tmp_path, block):
    """HF `quant_method: "fp8"` (transformers' FP8 / fine-grained FP8 layout): `weight` in e4m3 and
    `weight_scale_inv` per tensor, or per 128x128 block (re-quantized per channel here)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "fp8"
    out.mkdir()
    tensors, stored = {}, {}
    for name, w in load_file(str(source / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = w
            continue
        if block is None:
            scale = w.abs().amax().reshape(1) / 448
            expanded = scale
        else:
            blocks = w.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))
            scale = blocks.abs().amax(dim=(1, 3)) / 448
            expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        q = (w / expanded).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        stored[name] = q.float() * expanded
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    (out / "config.json").write_text(json.dumps(config))
    model, _ = load_model(out)
    assert model.quantization == "fp8"
    down = model.layers[1].down_weight.dequantize()
    expected = stored["model.layers.1.mlp.down_proj.weight"]
    error = float((down - expected).abs().max() / expected.abs().max())
    assert error == 0.0 if block is None else error < 2**-4  # per tensor: the same values; blocks: one fp8 rounding
