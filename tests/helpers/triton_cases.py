"""Checks of splitserve.engine.ops.triton_decode_attention, triton_kernels and triton_lora against torch references, run on CPU by the Triton interpreter.

TRITON_INTERPRET must be set before the kernel modules are imported (triton.jit reads it when
decorating), so tests/engine/test_triton_kernels.py runs this file in a subprocess with the env set:
    TRITON_INTERPRET=1 python tests/helpers/triton_cases.py [case ...]
It prints one JSON object {case_name: "ok" | traceback}. Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback

import torch

_DTYPE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def reference_decode_attention(q, key_cache, value_cache, block_tables, context_lens, scale, window=None):
    """Dense fp64 attention over each sequence's gathered context (its last `window` tokens)."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    for seq in range(batch):
        length = int(context_lens[seq])
        if length == 0:
            continue
        blocks = block_tables[seq, : math.ceil(length / block_size)].long()
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].double()
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].double()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        if window is not None:
            first = max(length - window, 0)
            keys, values = keys[first:], values[first:]
        scores = torch.einsum("hd,lhd->hl", q[seq].double(), keys) * scale
        out[seq] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values)
    return out


def _random_paged_problem(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(length / block_size) for length in context_lens) + 1
    num_blocks = len(context_lens) * max_blocks + 3
    q = torch.randn(len(context_lens), num_q_heads, head_dim, generator=generator).to(dtype)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    # Distinct, shuffled physical blocks per sequence; unused table slots stay 0 (padding).
    physical = torch.randperm(num_blocks - 1, generator=generator) + 1
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    cursor = 0
    for seq, length in enumerate(context_lens):
        needed = math.ceil(length / block_size)
        block_tables[seq, :needed] = physical[cursor : cursor + needed].int()
        cursor += needed
    return q, key_cache, value_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32)


def _check_decode(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, num_splits=None):
    from splitserve.engine.ops.attention import paged_decode_attention_torch
    from splitserve.engine.ops.triton_decode_attention import paged_decode_attention

    q, key_cache, value_cache, block_tables, lens = _random_paged_problem(
        context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))  # every element must be written
    paged_decode_attention(q, key_cache, value_cache, block_tables, lens, scale, out=out, num_splits=num_splits)
    expected = reference_decode_attention(q, key_cache, value_cache, block_tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = _DTYPE_TOLERANCE[dtype]
    error = (out.double() - expected).abs().max().item()
    assert error <= tolerance, f"max abs error {error} > {tolerance}"
    if dtype == torch.float32 and min(context_lens) > 0:  # the engine's torch path, same inputs
        torch_out = paged_decode_attention_torch(q, key_cache, value_cache, block_tables, lens, scale)
        error = (out - torch_out).abs().max().item()
        assert error <= tolerance, f"vs paged_decode_attention_torch: {error} > {tolerance}"


def case_gqa_fp32_small_tiles():
    # block_size 4, head_dim 8: the broadcast-sum path; partial last blocks; group of 2.
    _check_decode([1, 7, 12], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def case_gqa_fp32_dot_tiles():
    # block_size 16, head_dim 16: the tl.dot path; group of 4; one exact-multiple length.
    _check_decode([5, 16, 33], num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)


def case_mha_fp32_odd_block_size():
    # block_size 3 (not a power of two) and group 1 (plain multi-head attention).
    _check_decode([2, 9, 10], num_q_heads=2, num_kv_heads=2, head_dim=8, block_size=3, dtype=torch.float32)


def case_gqa_bf16_small_tiles():
    # Only the broadcast-sum path: triton 3.9's interpreter runs tl.dot on bf16 as np.matmul
    # over the raw uint16 storage (garbage), so the bf16 tl.dot path needs a GPU to check.
    _check_decode([6, 13], num_q_heads=4, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.bfloat16)


def case_gqa_fp16_both_paths():
    _check_decode([11, 4], num_q_heads=6, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    _check_decode([20, 3], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float16)


def case_split_context_gqa_groups_head_dims():
    # Several context splits, ragged lengths (a 1-token context leaves most splits empty),
    # query groups of 1, 4 and 5, head_dim 64 and 80 (BLOCK_D 128 masked), multi-block tiles.
    _check_decode(
        [1, 9, 37], num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.float32, num_splits=3
    )
    _check_decode([30, 5], num_q_heads=8, num_kv_heads=2, head_dim=80, block_size=4, dtype=torch.float32, num_splits=4)
    _check_decode([21, 40], num_q_heads=5, num_kv_heads=1, head_dim=64, block_size=4, dtype=torch.float32, num_splits=5)
    # More splits than a sequence has blocks; a block size that is not a power of two.
    _check_decode([7, 2], num_q_heads=4, num_kv_heads=1, head_dim=8, block_size=3, dtype=torch.float32, num_splits=6)


def case_split_context_half_precision_and_dot_tiles():
    _check_decode(
        [33, 70], num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float16, num_splits=2
    )
    _check_decode([19, 6], num_q_heads=4, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.bfloat16, num_splits=3)


def case_split_context_empty_context_gives_zeros():
    from splitserve.engine.ops.triton_decode_attention import paged_decode_attention

    q, key_cache, value_cache, block_tables, _ = _random_paged_problem([9, 9], 2, 1, 8, 4, torch.float32, seed=5)
    lens = torch.tensor([0, 9], dtype=torch.int32)
    out = paged_decode_attention(q, key_cache, value_cache, block_tables, lens, 0.5, num_splits=3)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = reference_decode_attention(q, key_cache, value_cache, block_tables, lens, 0.5)
    assert torch.allclose(out[1].double(), expected[1], atol=1e-5)


def case_empty_context_gives_zeros_and_out_is_reused():
    from splitserve.engine.ops.triton_decode_attention import paged_decode_attention

    q, key_cache, value_cache, block_tables, _ = _random_paged_problem([4, 4], 2, 1, 8, 4, torch.float32, seed=1)
    lens = torch.tensor([0, 4], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    returned = paged_decode_attention(q, key_cache, value_cache, block_tables, lens, 0.5, out=out)
    assert returned is out
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = reference_decode_attention(q, key_cache, value_cache, block_tables, lens, 0.5)
    assert torch.allclose(out[1].double(), expected[1], atol=1e-5)


def case_decode_reads_layer_view_of_full_cache():
    # The engine passes kv[layer, 0] / kv[layer, 1]: views into the 6-D cache.
    from splitserve.engine.ops.triton_decode_attention import paged_decode_attention

    generator = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 2, 6, 4, 2, 8, generator=generator)  # [layer, K|V, block, offset, head, dim]
    q = torch.randn(2, 4, 8, generator=generator)
    block_tables = torch.tensor([[5, 2], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    out = paged_decode_attention(q, kv[1, 0], kv[1, 1], block_tables, lens, 0.3)
    expected = reference_decode_attention(q, kv[1, 0], kv[1, 1], block_tables, lens, 0.3)
    assert torch.allclose(out.double(), expected, atol=1e-5)


def _check_windowed_decode(context_lens, window, num_q_heads, num_kv_heads, head_dim, block_size, dtype, splits=None):
    """A sliding-window layer's decode: the kernel reads only each sequence's last `window`
    tokens. The table entries wholly before a window point at a NaN block, as a freed block
    (engine/core/kv_cache_manager.py) may hold anything: one read of it would show."""
    from splitserve.engine.ops.attention import paged_decode_attention_torch
    from splitserve.engine.ops.triton_decode_attention import paged_decode_attention

    q, key_cache, value_cache, block_tables, lens = _random_paged_problem(
        context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=4
    )
    expected = reference_decode_attention(q, key_cache, value_cache, block_tables, lens, 0.4, window)
    freed = key_cache.shape[0]
    key_cache = torch.cat((key_cache, torch.full_like(key_cache[:1], float("nan"))))
    value_cache = torch.cat((value_cache, torch.full_like(value_cache[:1], float("nan"))))
    for seq, length in enumerate(context_lens):
        block_tables[seq, : max(length - window, 0) // block_size] = freed
    out = paged_decode_attention(q, key_cache, value_cache, block_tables, lens, 0.4, window=window, num_splits=splits)
    # The torch paths: the batch (CPU fp32: the sparse plan; else gather + SDPA) and one sequence.
    torch_batch = paged_decode_attention_torch(q, key_cache, value_cache, block_tables, lens, 0.4, window=window)
    torch_single = torch.cat(
        [
            paged_decode_attention_torch(
                q[i : i + 1], key_cache, value_cache, block_tables[i : i + 1], lens[i : i + 1], 0.4, window=window
            )
            for i in range(len(context_lens))
        ]
    )
    tolerance = _DTYPE_TOLERANCE[dtype]
    for name, result in (("triton", out), ("torch batch", torch_batch), ("torch single", torch_single)):
        error = (result.double() - expected).abs().max().item()
        assert error <= tolerance, f"{name}: max abs error {error} > {tolerance}"


def case_sliding_window_decode_both_paths():
    # Broadcast-sum tiles; windows ending mid-block, on a block edge, and longer than a context.
    _check_windowed_decode(
        [3, 13, 26, 41], 9, num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32
    )
    _check_windowed_decode(
        [17, 40, 64], 16, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32
    )


def case_sliding_window_decode_split_context():
    # Split boundaries inside the window (window 22 = 6-7 blocks of 4 over 3 splits); a context
    # shorter than its window; group 5, head_dim 80.
    _check_windowed_decode([9, 30, 47], 22, 5, 1, 80, 4, torch.float32, splits=3)
    _check_windowed_decode([40, 64], 33, 8, 2, 16, 16, torch.float32, splits=2)


def case_sliding_window_decode_half_precision():
    _check_windowed_decode([30, 7], 10, num_q_heads=6, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)


def case_gather_scatter_round_trip():
    from splitserve.engine.ops.triton_kernels import gather_blocks, scatter_blocks

    generator = torch.Generator().manual_seed(3)
    for dtype, id_dtype in ((torch.float32, torch.int64), (torch.bfloat16, torch.int32)):
        # row_numel 1500 > the kernel's 1024-element chunk: exercises the chunk mask.
        paged = torch.randn(4, 9, 1500, generator=generator).to(dtype)
        ids = torch.tensor([7, 2, 5], dtype=id_dtype)
        packed = torch.empty(4, 3, 1500, dtype=dtype)
        assert gather_blocks(paged, ids, packed) is packed
        assert torch.equal(packed, paged[:, ids.long()])
        restored = torch.zeros_like(paged)
        scatter_blocks(packed, restored, ids)
        assert torch.equal(restored[:, ids.long()], paged[:, ids.long()])
        untouched = [b for b in range(9) if b not in ids.tolist()]
        assert torch.count_nonzero(restored[:, untouched]) == 0


def case_gather_from_strided_planes():
    # Every other plane of a bigger tensor: the plane stride differs from planes * rows * E.
    from splitserve.engine.ops.triton_kernels import gather_blocks, scatter_blocks

    base = torch.arange(6 * 5 * 7, dtype=torch.float32).view(6, 5, 7)
    planes = base[::2]
    ids = torch.tensor([4, 0], dtype=torch.int64)
    packed = torch.empty(3, 2, 7)
    gather_blocks(planes, ids, packed)
    assert torch.equal(packed, planes[:, ids])
    target = torch.zeros(6, 5, 7)
    scatter_blocks(packed, target[1::2], ids)
    assert torch.equal(target[1::2][:, ids], planes[:, ids])
    assert torch.count_nonzero(target[::2]) == 0


def _check_quantized_decode(
    kv_cache_dtype, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, q_dtype, splits=None
):
    from splitserve.engine.ops.triton_decode_attention import paged_decode_attention
    from tests.helpers.quantized_kv_cases import ATTENTION_TOLERANCE, dequantized_layer, quantized_paged_problem

    q, cache, keys, values, tables, lens = quantized_paged_problem(
        context_lens, num_q_heads, num_kv_heads, head_dim, block_size, kv_cache_dtype
    )
    q = q.to(q_dtype)
    k, v = cache.key_cache(0), cache.value_cache(0)
    scale = head_dim**-0.5
    scales = {"key_scales": k.scales, "value_scales": v.scales}
    out = paged_decode_attention(q, k.values, v.values, tables, lens, scale, **scales, num_splits=splits)
    assert out.dtype == q_dtype
    # Exact against the dequantized cache (the kernel's own error) ...
    dense_k, dense_v = dequantized_layer(cache)
    on_dequantized = reference_decode_attention(q.float(), dense_k, dense_v, tables, lens, scale)
    kernel_error = (out.double() - on_dequantized).abs().max().item()
    assert kernel_error <= _DTYPE_TOLERANCE[q_dtype], f"{kernel_error} vs the dequantized cache"
    # ... and within the stated tolerance of fp32 attention over the unquantized K/V.
    exact = reference_decode_attention(q.float(), keys, values, tables, lens, scale)
    error = (out.double() - exact).abs().max().item()
    assert error <= ATTENTION_TOLERANCE[kv_cache_dtype], f"{kv_cache_dtype}: {error} vs fp32 attention"


def case_fp8_kv_both_paths():
    # Broadcast-sum tiles (block 4, head_dim 8) and tl.dot tiles (16, 16), on the cache's strided byte rows.
    _check_quantized_decode("fp8", [1, 7, 12], 4, 2, 8, 4, torch.float32)
    _check_quantized_decode("fp8", [5, 16, 33], 8, 2, 16, 16, torch.float32)


def case_int8_kv_both_paths():
    _check_quantized_decode("int8", [6, 13], 4, 1, 8, 4, torch.float32)
    _check_quantized_decode("int8", [20, 3], 4, 2, 16, 16, torch.float32)


def case_quantized_kv_split_context():
    # 8-bit K/V with per-(token, head) scales, over several splits: groups 4 and 5, head_dim 64/80.
    _check_quantized_decode("int8", [3, 29, 40], 8, 2, 64, 4, torch.float32, splits=4)
    _check_quantized_decode("fp8", [26, 11], 5, 1, 80, 4, torch.float32, splits=3)
    _check_quantized_decode("fp8", [35, 16], 8, 2, 16, 16, torch.float16, splits=2)


def case_fp8_kv_fp16_queries():
    _check_quantized_decode("fp8", [11, 4], 6, 2, 8, 4, torch.float16)


def case_lora_shrink_expand_fp32_rank4_and_rank8():
    # in_dim 24 and out 40 are no multiples of the tiles: the masks; slots in any token order.
    from tests.helpers.triton_lora_cases import check_lora

    check_lora(torch.float32, rank=4)
    check_lora(torch.float32, rank=8, in_dim=130, out_dim=70)


def case_lora_shrink_expand_half_precision():
    from tests.helpers.triton_lora_cases import check_lora

    check_lora(torch.float16, rank=8)
    check_lora(torch.bfloat16, rank=4)


def case_lora_batch_kernel_matches_torch_layouts():
    # engine/lora/lora_batch.py's CUDA path (use_kernel=True) against its torch layouts.
    from tests.helpers.triton_lora_cases import check_lora_batch_kernel

    check_lora_batch_kernel()


def case_lora_engine_greedy_through_kernel():
    from tests.helpers.triton_lora_cases import check_engine_greedy_through_kernel

    check_engine_greedy_through_kernel()


CASES = {name: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def run_cases(names: list[str]) -> dict[str, str]:
    results = {}
    for name in names:
        try:
            CASES[name]()
            results[name] = "ok"
        except Exception:  # report every failure, keep checking the rest
            results[name] = traceback.format_exc()
    return results


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1: these checks run the kernels on CPU")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(json.dumps(run_cases(sys.argv[1:] or list(CASES))))
