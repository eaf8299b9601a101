"""Quantization quality checks shared by the dense and the mixture-of-experts tests: teacher-
forced agreement with full precision, and the deliberate bug a check must catch."""

from __future__ import annotations

import torch

from splitserve.bench.quantization.quantization import PROMPTS as BENCH_PROMPTS
from tests.helpers.model import contiguous_metadata, make_kv_cache

PROMPTS = list(BENCH_PROMPTS[:6])  # the quantization benchmark's first six


def logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits, one prefill through a paged cache."""
    cache, blocks_per_seq = make_kv_cache(model, len(ids))
    meta = contiguous_metadata([len(ids)], [len(ids)], 16, blocks_per_seq)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))


def agreement(model, sequences: list[list[int]], prompt_lens: list[int]) -> float:
    """Fraction of continuation positions where the model's next-token argmax is the
    full-precision model's greedy token (sequences: prompt + that continuation)."""
    hits = total = 0
    for ids, start in zip(sequences, prompt_lens):
        predicted = logits(model, ids).argmax(-1)[start - 1 : -1]
        hits += int((predicted == torch.tensor(ids[start:])).sum())
        total += len(ids) - start
    return hits / total


def collapse_scales(weights) -> None:
    """The deliberate bug: each matrix quantized per channel (or group), dequantized with one
    shared scale."""
    with torch.inference_mode():
        for weight in weights:
            if hasattr(weight, "scales_and_zeros"):  # int4: per-group scales
                weight.scales_and_zeros[..., 0].fill_(weight.scales_and_zeros[..., 0].float().mean())
            else:
                weight.scale.fill_(weight.scale.mean())
                if hasattr(weight, "scale_bf16"):
                    weight.scale_bf16.copy_(weight.scale)
