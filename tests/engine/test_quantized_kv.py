"""The fp8/int8 KV cache: quantization bounds, its byte layout (scales inside each block's row,
so block copies and transfers carry them), and torch-path attention over it against fp32.
The Triton kernel's quantized cases run under the interpreter (tests/helpers/triton_cases.py)."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.kv_cache_sizing import kv_bytes_per_block
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.attention import paged_attention, paged_decode_attention_torch
from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.ops.quantized_kv import STORAGE_DTYPES, QuantizedKV, dequantize, quantize
from tests.helpers.quantized_kv_cases import ATTENTION_TOLERANCE, quantized_cache, quantized_paged_problem
from tests.helpers.triton_cases import reference_decode_attention

KV_DTYPES = ("fp8", "int8")


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_quantize_round_trip_within_the_format_step(kv_cache_dtype):
    x = torch.randn(64, 3, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None, None]
    values, scales = quantize(x, STORAGE_DTYPES[kv_cache_dtype])
    assert values.dtype == STORAGE_DTYPES[kv_cache_dtype] and scales.dtype == torch.float16
    error = (dequantize(values, scales, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if kv_cache_dtype == "int8":  # half a step of amax / 127 (plus the float16 scale's rounding)
        assert (error <= amax * (0.5 / 127 + 1e-3)).all()
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 (subnormals: an absolute step)
        assert (error <= x.abs() * 2**-4 + amax * 2**-9 / 448 * 64).all()
    zeros, zero_scales = quantize(torch.zeros(2, 1, 8), STORAGE_DTYPES[kv_cache_dtype])
    assert torch.equal(dequantize(zeros, zero_scales, torch.float32), torch.zeros(2, 1, 8))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", *KV_DTYPES])
def test_block_bytes_match_the_sizing_and_hold_the_scales(kv_cache_dtype):
    cache = quantized_cache(6, 4, 4, 2, 8, kv_cache_dtype, num_layers=3)
    model = ModelConfig("LlamaForCausalLM", 8, 32, 8, 3, 4, 2, 8, 4096)
    assert cache.bytes_per_block == kv_bytes_per_block(model, 4, kv_cache_dtype, "float32")
    if kv_cache_dtype == "auto":
        assert cache.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 4
        return
    assert cache.bytes_per_block == 3 * 2 * (4 * 2 * 8 + 4 * 2 * 2)  # values + float16 scales
    # A token written to block 3 changes block 3's row of its layer (values and scale) only.
    before = cache.kv.clone()
    key = cache.key_cache(1)
    assert isinstance(key, QuantizedKV)
    key.write(torch.full((1, 2, 8), 3.0), torch.tensor([3 * 4 + 2]))
    changed = (cache.kv != before).nonzero()[:, :3].unique(dim=0).tolist()
    assert changed == [[1, 0, 3]]
    planes = cache.layer_planes(1)
    assert planes.dtype == torch.uint8 and planes.shape == (2, 6, cache.bytes_per_block_per_layer // 2)
    assert torch.allclose(key.gather(torch.tensor([3]), torch.float32)[0, 2], torch.full((2, 8), 3.0), rtol=1e-3)


def test_unknown_kv_cache_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="-", kv_cache_dtype="fp4")


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("context_lens", [[37], [1, 7, 12], [5, 16, 33, 64]])
def test_torch_decode_over_quantized_cache_matches_fp32(kv_cache_dtype, context_lens):
    q, cache, keys, values, tables, lens = quantized_paged_problem(context_lens, 8, 2, 16, 4, kv_cache_dtype, seed=3)
    scale = 16**-0.5
    out = paged_decode_attention_torch(q, cache.key_cache(0), cache.value_cache(0), tables, lens, scale)
    exact = reference_decode_attention(q, keys, values, tables, lens, scale)
    assert (out.double() - exact).abs().max() <= ATTENTION_TOLERANCE[kv_cache_dtype]
    # The tolerance is tight enough to catch dropped scales (values read as if scale were 1).
    k = cache.key_cache(0)
    unscaled = QuantizedKV(k.values, torch.ones_like(k.scales))
    broken = paged_decode_attention_torch(q, unscaled, cache.value_cache(0), tables, lens, scale)
    assert (broken.double() - exact).abs().max() > ATTENTION_TOLERANCE[kv_cache_dtype]


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_chunk_after_cached_prefix_and_decode_in_one_batch(kv_cache_dtype):
    """paged_attention with a 20-token chunk after a 13-token cached prefix next to two decode
    rows: every row within tolerance of fp32 causal attention over the unquantized K/V."""
    gen = torch.Generator().manual_seed(5)
    block_size, heads, kv_heads, dim = 4, 4, 2, 16
    cache = quantized_cache(32, block_size, heads, kv_heads, dim, kv_cache_dtype)
    lengths, new = [33, 9, 17], [20, 1, 1]
    tables = [list(range(1, 10)), list(range(10, 13)) + [0] * 6, list(range(13, 18)) + [0] * 4]
    dense_k = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    dense_v = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    slots = lambda seq, positions: [tables[seq][p // block_size] * block_size + p % block_size for p in positions]  # noqa: E731
    for seq, n in enumerate(lengths):  # the cached part first (prefix / earlier tokens)
        cached = range(n - new[seq])
        cache.key_cache(0).write(dense_k[seq][: len(cached)], torch.tensor(slots(seq, cached)))
        cache.value_cache(0).write(dense_v[seq][: len(cached)], torch.tensor(slots(seq, cached)))
    new_slots = sum((slots(seq, range(n - new[seq], n)) for seq, n in enumerate(lengths)), [])
    new_k = torch.cat([dense_k[seq][n - new[seq] :] for seq, n in enumerate(lengths)])
    new_v = torch.cat([dense_v[seq][n - new[seq] :] for seq, n in enumerate(lengths)])
    cache.key_cache(0).write(new_k, torch.tensor(new_slots))
    cache.value_cache(0).write(new_v, torch.tensor(new_slots))
    starts = [0, 20, 21, 22]
    meta = AttentionMetadata.build(new_slots, starts, lengths, tables, 20, "cpu")
    q = torch.randn(22, heads, dim, generator=gen)
    out = paged_attention(q, cache.key_cache(0), cache.value_cache(0), meta, dim**-0.5, new_k, new_v)
    for seq, n in enumerate(lengths):
        keys = dense_k[seq].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        vals = dense_v[seq].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        rows = q[starts[seq] : starts[seq + 1]].transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - new[seq], n)[:, None]
        scores = (rows @ keys.transpose(1, 2)) * dim**-0.5
        exact = (scores.masked_fill(~mask, -math.inf).softmax(-1) @ vals).transpose(0, 1)
        assert (out[starts[seq] : starts[seq + 1]] - exact).abs().max() <= ATTENTION_TOLERANCE[kv_cache_dtype]


def test_engine_kv_cache_is_quantized_only_when_asked(tmp_path):
    model = ModelConfig("LlamaForCausalLM", 8, 32, 8, 2, 4, 2, 8, 4096)
    auto = KVCache(model, EngineConfig(model="-", num_kv_blocks=4))
    fp8 = KVCache(model, EngineConfig(model="-", num_kv_blocks=4, kv_cache_dtype="fp8"))
    assert not auto.quantized and auto.dtype == torch.float32 and isinstance(auto.key_cache(0), torch.Tensor)
    assert fp8.quantized and fp8.key_cache(1).dtype == torch.float8_e4m3fn
    assert fp8.bytes_per_block < auto.bytes_per_block / 2
