"""Build a LlamaForCausalLM from a Hugging Face checkpoint directory."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from splitserve.engine.config import DTYPES, QUANTIZATIONS
from splitserve.engine.model.checkpoint import CheckpointError, iterate_weights, require_model_dir, weight_files
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.scripted_decode import cpu_decode_forward
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.kv_cache import DTYPE_BY_NAME
from splitserve.engine.ops.onednn_packed_weight import cpu_matmul
from splitserve.engine.parallel.quantized_shards import quantized_read_slice, shard_quantized
from splitserve.engine.parallel.shard_plan import check_quantized_split
from splitserve.engine.quant.prequantized_weights import prequantized_weights

if TYPE_CHECKING:
    from splitserve.engine.parallel.tp_group import TensorParallelGroup

__all__ = ["CheckpointError", "load_model"]


def load_model(
    model_dir: str | Path,
    dtype: str | None = None,
    device: str | torch.device = "cpu",
    quantization: str = "none",
    tensor_parallel: TensorParallelGroup | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Read config.json and the safetensors weights (single file or sharded) of model_dir.

    dtype defaults to the checkpoint's; quantization (none|int8|fp8|int4) quantizes the
    decoder layers' matmul weights one by one as they are read (engine/quant). On CPU the
    full-precision matmul weights are then packed for oneDNN (engine/ops/onednn_packed_weight.py;
    SPLITSERVE_CPU_MATMUL=blas keeps them plain), and its decode steps run as one TorchScript
    call (engine/model/scripted_decode.py; SPLITSERVE_CPU_DECODE_FORWARD=eager keeps the eager
    forward). Raises CheckpointError for a missing directory or
    file, a missing/unexpected/misshapen weight, and ConfigError (a ValueError) for a config
    splitserve cannot run, e.g. an unsupported architecture.

    tensor_parallel: this rank's group; the model is then its shard, each tensor read as only
    this rank's slice of the file (engine/parallel/shard_plan.py), with no scripted decode step;
    quantized, it holds exactly its slice of TP 1's values and scales
    (engine/parallel/quantized_shards.py).
    """
    root = require_model_dir(model_dir)
    config = ModelConfig.from_pretrained(root)
    if dtype is not None:
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        config.dtype = dtype
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    stored = config.checkpoint_scheme  # a pre-quantized checkpoint runs in its own scheme
    if stored is not None and quantization not in ("none", stored.scheme):
        raise CheckpointError(
            f"{root} is quantized as {stored.scheme} ({stored.method} {stored.format}); "
            f"--quantization {quantization} disagrees (leave it unset)"
        )
    scheme = quantization if stored is None else stored.scheme
    plan = None if tensor_parallel is None else tensor_parallel.plan
    if plan is None:
        weights = iterate_weights(root)
    elif scheme == "none":  # only this rank's slice of each tensor is read from the files
        weights = iterate_weights(root, plan.checkpoint_slice)
    else:  # what a rank must quantize or assemble whole first is read whole (quantized_shards.py)
        check_quantized_split(config, plan.size, scheme)
        weights = iterate_weights(root, quantized_read_slice(plan, scheme, stored is not None))
    if stored is not None:
        quantization = stored.scheme
        weights = prequantized_weights(weights, stored)
    if plan is not None and scheme != "none":
        weights = shard_quantized(weights, plan, scheme, stored is not None)
    weight_files(root)  # fail on missing weight files before allocating the model
    model_class = _model_class(config)
    model = model_class(
        config,
        dtype=DTYPE_BY_NAME[config.dtype],
        device=device,
        quantization=quantization,
        tensor_parallel=tensor_parallel,
    )
    model.load_weights(weights)
    if torch.device(device).type == "cpu" and cpu_matmul() == "onednn":
        model.pack_matmul_weights()
    if torch.device(device).type == "cpu" and cpu_decode_forward() == "scripted" and tensor_parallel is None:
        model.use_scripted_decode()
    model.eval()
    return model, config


def _model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The registry's class for the checkpoint's architecture (engine/model/architectures.py)."""
    module_name, class_name = config.registered.model_class.split(":")
    return getattr(importlib.import_module(module_name), class_name)
