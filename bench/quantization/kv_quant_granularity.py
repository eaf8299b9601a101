"""Which KV scales keep quality for their bytes: per (token, head) vs per (block, head).

Captures every layer's real queries, keys and values from a model's prefill of held-out text
(the engine's own forward pass: `paged_attention` is wrapped to record its inputs), quantizes
K and V each way, and compares causal attention over the dequantized K/V with fp32 attention
over the originals: relative error ||out_q - out|| / ||out||, per layer, averaged.

  per (token, head)   one float16 scale per token and kv head (what the engine stores)
  per (block, head)   one float32 scale per block of block_size tokens and kv head, from the
                      whole block's amax -- its best case: a block filled a token at a time
                      during decode would have to fix (or re-quantize to) its scale early
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from splitserve.engine.ops.quantized_kv import STORAGE_DTYPES, dequantize, quantize

SCHEMES = ("token", "block")


@contextlib.contextmanager
def captured_attention_inputs(engine, records: list):
    """Append (q, k, v) [T, H, D] of every layer's paged_attention call while active, each over
    every prompt row: engine's runner passes the model no output_rows meanwhile (which would
    leave the last layer attending for the sampled rows only)."""
    from splitserve.engine.model import layers

    original = layers.paged_attention
    runner = engine.runner
    reads_out = runner.selects_output_rows
    runner.selects_output_rows = False

    def recording(q, key_cache, value_cache, meta, scale, new_keys=None, new_values=None, **kw):
        records.append((q.detach().clone(), new_keys.detach().clone(), new_values.detach().clone()))
        return original(q, key_cache, value_cache, meta, scale, new_keys=new_keys, new_values=new_values, **kw)

    layers.paged_attention = recording
    try:
        yield records
    finally:
        layers.paged_attention = original
        runner.selects_output_rows = reads_out


def _block_quantized(x: torch.Tensor, storage: torch.dtype, block_size: int) -> torch.Tensor:
    """x [T, H, D] through per-(block, head) quantization, dequantized to fp32."""
    tokens, heads, dim = x.shape
    padded = -(-tokens // block_size) * block_size
    blocks = F.pad(x.float(), (0, 0, 0, 0, 0, padded - tokens)).view(-1, block_size, heads, dim)
    qmax = 448.0 if storage == torch.float8_e4m3fn else 127.0
    scales = (blocks.abs().amax(dim=(1, 3), keepdim=True) / qmax).clamp(min=1e-7)
    scaled = (blocks / scales).clamp(-qmax, qmax)
    if storage == torch.int8:
        scaled = scaled.round()
    return (scaled.to(storage).float() * scales).view(padded, heads, dim)[:tokens]


def roundtrip(x: torch.Tensor, kv_cache_dtype: str, scheme: str, block_size: int) -> torch.Tensor:
    storage = STORAGE_DTYPES[kv_cache_dtype]
    if scheme == "token":
        values, scales = quantize(x, storage)
        return dequantize(values, scales, torch.float32)
    return _block_quantized(x, storage, block_size)


def bytes_per_value(scheme: str, head_dim: int, block_size: int) -> float:
    """Bytes per K or V element, scales included."""
    scale_bytes = 2 / head_dim if scheme == "token" else 4 / (head_dim * block_size)
    return 1 + scale_bytes


def _causal_attention(q, k, v, scale) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        is_causal=True, scale=scale, enable_gqa=gqa,
    )  # fmt: skip
    return out.transpose(0, 1)


def attention_errors(records, head_dim: int, block_size: int) -> dict[tuple[str, str], dict[str, float]]:
    """(kv dtype, scheme) -> {relative attention error, K and V relative errors} averaged over layers."""
    scale = head_dim**-0.5
    results = {}
    for kv_cache_dtype in STORAGE_DTYPES:
        for scheme in SCHEMES:
            attn, kerr, verr = [], [], []
            for q, k, v in records:
                exact = _causal_attention(q, k, v, scale)
                kq, vq = (
                    roundtrip(k, kv_cache_dtype, scheme, block_size),
                    roundtrip(v, kv_cache_dtype, scheme, block_size),
                )
                approx = _causal_attention(q, kq, vq, scale)
                attn.append(((approx - exact).norm() / exact.norm()).item())
                kerr.append(((kq - k.float()).norm() / k.float().norm()).item())
                verr.append(((vq - v.float()).norm() / v.float().norm()).item())
            results[(kv_cache_dtype, scheme)] = {
                "attention": sum(attn) / len(attn),
                "keys": sum(kerr) / len(kerr),
                "values": sum(verr) / len(verr),
                "bytes_per_value": bytes_per_value(scheme, head_dim, block_size),
            }
    return results
