"""Rotary position embeddings (neox-style rotate_half, as in HF Llama), with Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from splitserve.engine.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """inv_freq [head_dim // 2] in float32, computed exactly like transformers' rope init."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (any strides) by cos/sin [T, D/2]; returns a new [T, H, D] tensor.

    out[:h] = x1*cos - x2*sin and out[h:] = x2*cos + x1*sin is HF's
    x*cat(cos,cos) + rotate_half(x)*cat(sin,sin) computed without the cat. TorchScript
    compiles it as it is (the scripted decode step).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin)
    return out


class RotaryEmbedding:
    """cos/sin tables for every position up to max_position_embeddings, looked up by position id."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        inv_freq = inverse_frequencies(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # same product order as HF's forward
        # Only half is stored: cat(freqs, freqs) repeats it, so cos/sin halves are equal.
        self.cos_half = freqs.cos().to(dtype=dtype, device=device)
        self.sin_half = freqs.sin().to(dtype=dtype, device=device)
        self.max_position = config.max_position_embeddings

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D/2] cos and sin for int64 positions [T]."""
        return self.cos_half.index_select(0, positions), self.sin_half.index_select(0, positions)

    # The eager forward and the scripted decode step (engine/model/decode_graph.py) both call it.
    apply = staticmethod(rotate)
