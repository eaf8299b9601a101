"""A trained mixture-of-experts model without training one: the trained dense Llama (the default
served model) upcycled into a Mixtral. Every layer's MLP becomes num_experts experts, each its
copy perturbed by `noise` times the weight's own standard deviation (so the experts differ and
routing matters), under a random router; the k routing weights are renormalised (Mixtral), so
the model stays close to the dense one and confident on its training text, which is what a
quantization-quality check needs (random weights give a near-uniform model, where any error
hides)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_DENSE_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def upcycle_to_mixtral(
    dense_dir: Path, out_dir: Path, num_experts: int = 4, top_k: int = 2, noise: float = 0.02, seed: int = 0
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((dense_dir / "config.json").read_text())
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        router_aux_loss_coef=0.0,
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in load_file(str(dense_dir / "model.safetensors")).items():
        if ".mlp." not in name:
            weights[name] = tensor
            continue
        prefix, _, leaf = name.rpartition(".mlp.")
        projection = leaf.removesuffix(".weight")
        for e in range(num_experts):
            jitter = torch.randn(tensor.shape, generator=generator) * (noise * tensor.std())
            weights[f"{prefix}.block_sparse_moe.experts.{e}.{_DENSE_MLP[projection]}.weight"] = tensor + jitter
        if projection == "gate_proj":
            router = torch.randn(num_experts, tensor.shape[1], generator=generator) * 0.02
            weights[f"{prefix}.block_sparse_moe.gate.weight"] = router
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for extra in dense_dir.iterdir():
        if extra.suffix == ".json" and extra.name != "config.json":
            shutil.copy(extra, out_dir / extra.name)
    return out_dir
