"""Pack scattered KV blocks into a contiguous buffer for transfer, and unpack them back.

Runs the Triton kernel on CUDA tensors when triton imports, torch index ops otherwise (CPU).
Planes are the leading dim: K and V of one layer (KVCache.layer_planes), or all layers'
K and V (kv.view(2 * num_layers, num_blocks, -1)).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

# triton is an optional extra; torch ops cover every device. It is imported on the first
# CUDA copy, so CPU-only processes never pay for it.
HAS_TRITON = importlib.util.find_spec("triton") is not None
_triton_kernels = None


def _kernels():
    global HAS_TRITON, _triton_kernels
    if _triton_kernels is None and HAS_TRITON:
        try:
            from splitserve.engine.ops import triton_kernels

            _triton_kernels = triton_kernels
        except ImportError:
            HAS_TRITON = False
    return _triton_kernels


class BlockCopyError(ValueError):
    """Mismatched shapes, dtypes or devices between a paged tensor and its packed buffer."""


def _as_block_ids(block_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if not isinstance(block_ids, torch.Tensor):
        block_ids = torch.tensor(list(block_ids), dtype=torch.int64)
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise BlockCopyError(f"block_ids must be 1-D int32/int64, got {block_ids.dtype} {tuple(block_ids.shape)}")
    return block_ids.to(device, non_blocking=True)


def _check(packed: torch.Tensor, paged: torch.Tensor, num_ids: int) -> None:
    if packed.dim() != 3 or paged.dim() != 3:
        raise BlockCopyError(
            f"expected 3-D [planes, rows, row_numel] tensors, got {tuple(packed.shape)} and {tuple(paged.shape)}"
        )
    expected = (paged.shape[0], num_ids, paged.shape[2])
    if tuple(packed.shape) != expected:
        raise BlockCopyError(f"packed buffer is {tuple(packed.shape)}, expected {expected}")
    if packed.dtype != paged.dtype or packed.device != paged.device:
        raise BlockCopyError(f"packed {packed.dtype}@{packed.device} vs paged {paged.dtype}@{paged.device}")


def _use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and tensor.stride(-1) == 1 and _kernels() is not None


def gather_blocks(
    src: torch.Tensor, block_ids: torch.Tensor | Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """out[p, i] = src[p, block_ids[i]]: src [P, num_blocks, E] -> out [P, n, E] (contiguous)."""
    ids = _as_block_ids(block_ids, src.device)
    if src.dim() != 3:
        raise BlockCopyError(f"src must be [planes, num_blocks, row_numel], got {tuple(src.shape)}")
    if out is None:
        out = torch.empty(src.shape[0], ids.shape[0], src.shape[2], dtype=src.dtype, device=src.device)
    _check(out, src, ids.shape[0])
    if not out.is_contiguous():
        raise BlockCopyError("out must be contiguous (it is the transfer staging buffer)")
    if _use_triton(src):
        return _kernels().gather_blocks(src, ids, out)
    return torch.index_select(src, 1, ids, out=out)


def scatter_blocks(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """dst[p, block_ids[i]] = src[p, i]: src [P, n, E] into dst [P, num_blocks, E] in place.

    Block ids are not range-checked on CUDA (that would sync); the caller owns them.
    """
    ids = _as_block_ids(block_ids, dst.device)
    _check(src, dst, ids.shape[0])
    if _use_triton(dst) and src.stride(-1) == 1:
        return _kernels().scatter_blocks(src, dst, ids)
    return dst.index_copy_(1, ids.long(), src)
