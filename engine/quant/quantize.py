"""One entry point per linear layer: quantize a full-precision weight, and multiply by either kind."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.ops.onednn_packed_weight import OneDnnPackedWeight
from splitserve.engine.quant.fp8_weight import Fp8Weight
from splitserve.engine.quant.int4_weight import Int4Weight
from splitserve.engine.quant.int8_weight import Int8Weight
from splitserve.engine.quant.prequantized_weights import QuantizedParts

WEIGHT_CLASSES: dict[str, type[nn.Module]] = {"int8": Int8Weight, "fp8": Fp8Weight, "int4": Int4Weight}
QuantizedWeight = Int8Weight | Fp8Weight | Int4Weight
# One scale per output channel, over all of its inputs.
PER_CHANNEL: dict[str, type[Int8Weight] | type[Fp8Weight]] = {"int8": Int8Weight, "fp8": Fp8Weight}


def quantize_weight(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """weight [out, in] -> its quantized form under scheme (int8, fp8 or int4)."""
    try:
        cls = WEIGHT_CLASSES[scheme]
    except KeyError:
        raise ValueError(f"unknown quantization {scheme!r}; choose none, {', '.join(WEIGHT_CLASSES)}") from None
    return cls.quantize(weight)


def quantize_parts(weight: torch.Tensor, scheme: str) -> QuantizedParts:
    """weight [out, in] -> the values and per-channel scales quantize_weight would hold (int8,
    fp8), unpacked: a tensor-parallel rank keeps its columns of them (engine/parallel/quantized_shards.py)."""
    if scheme not in PER_CHANNEL:
        raise ValueError(f"quantize_parts takes a per-channel scheme ({', '.join(PER_CHANNEL)}), got {scheme!r}")
    return QuantizedParts(*PER_CHANNEL[scheme].quantize_values(weight))


def from_parts(parts, scheme: str) -> QuantizedWeight:
    """A weight from a pre-quantized checkpoint's values (engine/quant/prequantized_weights.py)."""
    if scheme == "int4":
        return Int4Weight(parts.q, parts.scale, parts.zero, parts.group_size)
    return WEIGHT_CLASSES[scheme](parts.q, parts.scale)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight; the quantized weight's own matmul otherwise (bias kept in float)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight(x)
    return out if bias is None else out.add_(bias)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage counted once (tied weights share one),
    and of every oneDNN-packed weight (an opaque tensor, neither parameter nor buffer)."""
    seen: set[int] = set()
    total = sum(m.nbytes() for m in module.modules() if isinstance(m, OneDnnPackedWeight))
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_meta or tensor.untyped_storage().data_ptr() in seen:
            continue
        seen.add(tensor.untyped_storage().data_ptr())
        total += tensor.untyped_storage().nbytes()
    return total
