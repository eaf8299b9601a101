"""Which of our schemes a pre-quantized checkpoint's `quantization_config` is (torch-free, so
ModelConfig and the preflight read it): compressed-tensors (what llm-compressor writes) FP8,
INT8 and INT4 weights, and Hugging Face's `quant_method: "fp8"`. Anything else is a one-line
error naming what the checkpoint uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED = (
    "compressed-tensors float-quantized (FP8, FP8_DYNAMIC), int-quantized (W8A8) and "
    "pack-quantized (W4A16, W8A16; GPTQ packing), or quant_method fp8"
)
COMPRESSED_FORMATS = ("float-quantized", "int-quantized", "pack-quantized", "naive-quantized")


class UnsupportedQuantization(ValueError):
    """A checkpoint quantized in a way splitserve cannot load."""


@dataclass(frozen=True)
class CheckpointScheme:
    """scheme: the engine's name (fp8|int8|int4); how the tensors are stored; the weight args."""

    scheme: str
    method: str  # "compressed-tensors" | "fp8"
    format: str  # compressed-tensors format, or "fp8" for HF
    num_bits: int
    strategy: str  # channel | tensor | group | block
    group_size: int | None = None
    symmetric: bool = True
    block_size: tuple[int, int] | None = None  # HF fp8 weight_block_size


def checkpoint_scheme(quantization_config: dict[str, Any] | None) -> CheckpointScheme | None:
    """None for a full-precision checkpoint; UnsupportedQuantization naming anything we cannot run."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method == "fp8":
        return _hf_fp8(quantization_config)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config)
    raise UnsupportedQuantization(
        f"quantization_config.quant_method {method!r} is not supported; supported: {SUPPORTED}"
    )


def _hf_fp8(config: dict[str, Any]) -> CheckpointScheme:
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedQuantization(
            f"fp8 checkpoint with activation_scheme {config['activation_scheme']!r}: only dynamic is supported"
        )
    block = config.get("weight_block_size")
    return CheckpointScheme(
        "fp8", "fp8", "fp8", 8, "block" if block else "tensor", block_size=tuple(block) if block else None
    )


def _compressed_tensors(config: dict[str, Any]) -> CheckpointScheme:
    fmt = config.get("format")
    name = f"compressed-tensors format {fmt!r}"
    if fmt not in COMPRESSED_FORMATS:
        raise UnsupportedQuantization(f"{name} is not supported; supported: {SUPPORTED}")
    if config.get("kv_cache_scheme"):
        raise UnsupportedQuantization(f"{name} with a kv_cache_scheme is not supported (use --kv-cache-dtype)")
    if (config.get("sparsity_config") or {}).get("format") not in (None, "dense"):
        raise UnsupportedQuantization(f"{name} with sparsity {config['sparsity_config']['format']!r} is not supported")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise UnsupportedQuantization(f"{name} has no config_groups")
    schemes = {_group_scheme(fmt, group) for group in groups}
    if len(schemes) != 1:
        raise UnsupportedQuantization(f"{name} mixes several weight schemes; one per checkpoint is supported")
    return schemes.pop()


def _group_scheme(fmt: str, group: dict[str, Any]) -> CheckpointScheme:
    weights = group.get("weights") or {}
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 0))
    strategy = weights.get("strategy", "tensor")
    described = f"compressed-tensors {fmt} {kind}{bits} weights ({strategy})"
    acts = group.get("input_activations")
    if acts and not acts.get("dynamic", False):
        raise UnsupportedQuantization(f"{described} with static activation scales is not supported")
    if kind == "float" and bits == 8 and strategy in ("channel", "tensor"):
        return CheckpointScheme("fp8", "compressed-tensors", fmt, 8, strategy)
    group_size = weights.get("group_size")
    if kind == "int" and bits == 8 and strategy in ("channel", "group") and weights.get("symmetric", True):
        return CheckpointScheme("int8", "compressed-tensors", fmt, 8, strategy, group_size)
    if kind == "int" and bits == 4 and strategy == "group" and group_size in (32, 64, 128, 256):
        return CheckpointScheme(
            "int4", "compressed-tensors", fmt, 4, "group", group_size, weights.get("symmetric", True)
        )
    raise UnsupportedQuantization(f"{described} are not supported; supported: {SUPPORTED}")
