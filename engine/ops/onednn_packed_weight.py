"""A full-precision matmul weight reordered once, at load, into oneDNN's blocked layout, and
multiplied by oneDNN instead of the default BLAS.

Why: on CPU, torch's F.linear runs MKL's sgemm. On the AMD EPYC (Zen, AVX-512) machines this
project runs on, MKL takes a slow path: at the bench preset's shapes (batch 32, 256 -> 2048,
one thread) F.linear ran 390 us where oneDNN with the weight pre-packed ran 165 us; 2.3-2.5x
from 2 to 2048 rows, 1.5x at 4096x4096 with one row, and bf16 2.5x at one row
(bench/results/overlap.md, "The forward's matmuls"). It is the same op and layout torch's own
compiler (Inductor's mkldnn fusion) uses for CPU linears: torch.ops.mkldnn._reorder_linear_weight
packs, torch.ops.mkldnn._linear_pointwise multiplies.

The packed tensor is an opaque mkldnn tensor: it has no strides and cannot be sliced or copied
into, so packing happens after the checkpoint is loaded (engine/model/loader.py), and anything
that needs the plain weight asks for `dense()`.

SPLITSERVE_CPU_MATMUL=blas keeps F.linear (the A/B switch the benchmark uses); the default,
onednn, packs wherever the probe below says oneDNN computes the same product.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# What the CPU's full-precision matmuls run on; see the module docstring.
CPU_MATMUL_ENV = "SPLITSERVE_CPU_MATMUL"
CPU_MATMULS = ("onednn", "blas")
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Row count oneDNN picks the packed layout for. The layout serves every row count (a decode
# step's batch and a prefill chunk alike: measured within 3% of a layout packed for that count).
_PACKED_FOR_ROWS = 32


def cpu_matmul() -> str:
    """The configured CPU matmul (SPLITSERVE_CPU_MATMUL); ValueError naming the choices."""
    value = os.environ.get(CPU_MATMUL_ENV, "onednn").strip().lower() or "onednn"
    if value not in CPU_MATMULS:
        raise ValueError(f"{CPU_MATMUL_ENV} must be one of {', '.join(CPU_MATMULS)}, got {value!r}")
    return value


def can_pack(weight: torch.Tensor) -> bool:
    """A plain 2-D CPU weight of a dtype oneDNN multiplies, on a torch built with oneDNN."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in PACKABLE_DTYPES
        and not weight.is_mkldnn
        and torch.backends.mkldnn.is_available()
    )


class OneDnnPackedWeight(nn.Module):
    """W [out, in] packed for oneDNN; called like the quantized weights: forward(x) = x @ W.T."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACKED_FOR_ROWS)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> OneDnnPackedWeight | None:
        """The packed weight, or None where oneDNN cannot take it or disagrees with F.linear on
        a probe (an old CPU without the instructions its kernels were built for, a torch
        build whose op misbehaves): then the caller keeps the plain weight."""
        if not can_pack(weight):
            return None
        try:
            packed = cls(weight)
            probe = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=weight.dtype).reshape(3, -1)
            expected = F.linear(probe, weight)
            got = packed(probe)
        except RuntimeError:
            return None
        tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
        scale = expected.abs().max().clamp(min=1.0)
        return packed if bool(((got - expected).abs().max() / scale) <= tolerance) else None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize

    def dense(self) -> torch.Tensor:
        """The plain [out, in] weight (a copy)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"activations are {x.dtype}, the packed weight is {self.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
