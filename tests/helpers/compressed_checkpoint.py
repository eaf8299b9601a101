"""Pre-quantized checkpoints written by the compressed-tensors library itself (what
llm-compressor calls to save): a transformers model, the library's quantization config for a
preset scheme applied, weight scales from its own calculate_qparams on min/max (what
llm-compressor's data-free min-max observer computes for weight-only and dynamic schemes),
compressed by ModelCompressor and saved with the config it writes. And transformers' own FP8
layout (`quant_method: "fp8"`), per tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def write_compressed_checkpoint(source: Path, out_dir: Path, preset: str) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or not hasattr(module, "weight_scale"):
            continue
        args, w = scheme.weights, module.weight.data
        if args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "group":
            groups = w.unflatten(-1, (-1, args.group_size))
            lo, hi = groups.amin(-1), groups.amax(-1)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero_point = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight" or not model.config.tie_word_embeddings
    }
    save_file(state, str(out_dir / "model.safetensors"))
    model.config.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out_dir / name)
    return out_dir


def write_hf_fp8_checkpoint(source: Path, out_dir: Path) -> Path:
    """`source` (one model.safetensors) with each decoder projection's weight in e4m3 and one
    `weight_scale_inv` per tensor (amax / 448), as transformers' FP8 quantizer stores it."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, w in load_file(str(source / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            scale = w.abs().amax().reshape(1) / 448
            tensors[name], tensors[name + "_scale_inv"] = (w / scale).to(torch.float8_e4m3fn), scale
        else:
            tensors[name] = w
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}
    (out_dir / "config.json").write_text(json.dumps(config))
    for path in source.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, out_dir / path.name)
    return out_dir
