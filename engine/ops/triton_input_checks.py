"""Argument checks of the Triton kernels (engine/ops/triton_decode_attention.py, triton_kernels.py,
triton_lora.py): shapes, dtypes,
devices and layouts, raised as KernelInputError before anything launches. No triton import."""

from __future__ import annotations

import torch

from splitserve.engine.config import DTYPES

_SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in DTYPES)
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


class KernelInputError(ValueError):
    """A kernel was called with tensors of the wrong shape, dtype, device or layout."""


def check_scales(key_cache, key_scales, value_scales) -> None:
    if key_cache.dtype not in _QUANTIZED_DTYPES:
        raise KernelInputError(f"a cache with scales must be one of {_QUANTIZED_DTYPES}, got {key_cache.dtype}")
    for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
        if scales is None or scales.shape != key_cache.shape[:3] or scales.dtype != torch.float16:
            raise KernelInputError(
                f"{name} must be float16 {tuple(key_cache.shape[:3])}, got "
                f"{None if scales is None else (scales.dtype, tuple(scales.shape))}"
            )
        if scales.stride(-1) != 1 or scales.stride() != key_scales.stride():
            raise KernelInputError(f"{name} must be contiguous in kv_head and strided as key_scales")


def check_attention_inputs(q, key_cache, value_cache, block_tables, context_lens, out, quantized=False) -> None:
    if q.dim() != 3:
        raise KernelInputError(f"q must be [batch, q_heads, head_dim], got {tuple(q.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise KernelInputError(
            "key_cache/value_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise KernelInputError(f"head_dim mismatch: q {head_dim}, cache {key_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise KernelInputError(f"q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise KernelInputError(
            f"block_tables must be int32 [{batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32:
        raise KernelInputError(
            f"context_lens must be int32 [{batch}], got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    for name, tensor in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        allowed = _QUANTIZED_DTYPES if quantized and name != "q" else _SUPPORTED_DTYPES
        if tensor.dtype not in allowed:
            raise KernelInputError(f"{name} dtype {tensor.dtype} not in {allowed}")
        if tensor.stride(-1) != 1:
            raise KernelInputError(f"{name} must be contiguous in head_dim")
    if quantized:
        if value_cache.dtype != key_cache.dtype:
            raise KernelInputError(f"key/value dtypes differ: {key_cache.dtype}, {value_cache.dtype}")
    elif key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise KernelInputError(f"q/key/value dtypes differ: {q.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise KernelInputError(f"out must be {tuple(q.shape)} and contiguous in head_dim")
    devices = {t.device for t in (q, key_cache, value_cache, block_tables, context_lens)}
    if out is not None:
        devices.add(out.device)
    if len(devices) != 1:
        raise KernelInputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_planes(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 3 or tensor.stride(-1) != 1:
        raise KernelInputError(
            f"{name} must be [planes, rows, row_numel] contiguous in its last dim, "
            f"got shape {tuple(tensor.shape)} strides {tensor.stride()}"
        )


def check_copy(packed: torch.Tensor, paged: torch.Tensor, block_ids: torch.Tensor) -> None:
    _check_planes("packed", packed)
    _check_planes("paged", paged)
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"block_ids must be 1-D int32/int64, got {block_ids.dtype} {tuple(block_ids.shape)}")
    if packed.shape != (paged.shape[0], block_ids.shape[0], paged.shape[2]):
        raise KernelInputError(
            f"packed buffer {tuple(packed.shape)} does not match paged {tuple(paged.shape)} "
            f"with {block_ids.shape[0]} block ids"
        )
    if packed.dtype != paged.dtype:
        raise KernelInputError(f"dtype mismatch: {packed.dtype} vs {paged.dtype}")
    if len({packed.device, paged.device, block_ids.device}) != 1:
        raise KernelInputError("src, dst and block_ids must be on one device")


def _check_token_slots(token_slots: torch.Tensor, tokens: int) -> None:
    if token_slots.shape != (tokens,) or token_slots.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"token_slots must be int32/int64 [{tokens}], got {token_slots.dtype} {tuple(token_slots.shape)}"
        )


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2 or tensor.stride(-1) != 1:
        raise KernelInputError(f"{name} must be [tokens, features] contiguous in features, got {tuple(tensor.shape)}")


def _check_one_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise KernelInputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def check_lora_shrink(x, a_t, token_slots, out) -> None:
    _check_rows("x", x)
    if a_t.dim() != 3 or a_t.shape[1] != x.shape[1]:
        raise KernelInputError(f"a_t must be [slots, {x.shape[1]}, cols], got {tuple(a_t.shape)}")
    _check_token_slots(token_slots, x.shape[0])
    if out is not None:
        _check_rows("out", out)
        if out.shape != (x.shape[0], a_t.shape[2]):
            raise KernelInputError(f"out must be [{x.shape[0]}, {a_t.shape[2]}], got {tuple(out.shape)}")
    _check_one_device(x, a_t, token_slots, *(() if out is None else (out,)))


def check_lora_expand(shrunk, b, token_slots, scaling, out) -> None:
    _check_rows("shrunk", shrunk)
    _check_rows("out", out)
    tokens, rank = shrunk.shape
    if b.dim() != 3 or b.shape[1] != rank:
        raise KernelInputError(f"b must be [slots, {rank}, cols], got {tuple(b.shape)}")
    if out.shape != (tokens, b.shape[2]):
        raise KernelInputError(f"out must be [{tokens}, {b.shape[2]}], got {tuple(out.shape)}")
    if scaling.shape != (b.shape[0],):
        raise KernelInputError(f"scaling must be [{b.shape[0]}] (one per slot), got {tuple(scaling.shape)}")
    _check_token_slots(token_slots, tokens)
    _check_one_device(shrunk, b, token_slots, scaling, out)
