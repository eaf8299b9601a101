"""Read a pre-quantized checkpoint's tensors into what the engine's quantized weights are made of.

A quantized projection arrives as several tensors (compressed-tensors: `weight` or
`weight_packed`, `weight_scale`, `weight_shape`, `weight_zero_point`; HF fp8: `weight` and
`weight_scale_inv`). They are gathered per projection and turned into QuantizedParts: the
checkpoint's own integers / fp8 values and scales in the engine's convention, so loading adds
no rounding (GPTQ int32 packing is undone by compressed-tensors' own unpack_from_int32). fp8
with 128x128 block scales (HF fp8) is the one layout the engine cannot hold as stored: it is
dequantized with the checkpoint's scales and re-quantized per channel.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from splitserve.engine.quant.checkpoint_scheme import CheckpointScheme

_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_scale_inv")


@dataclass
class QuantizedParts:
    """Rows of one quantized weight: q [rows, in] and scale [rows] (int8, fp8) or, for int4,
    q in [0, 15], scale and zero [rows, in // group_size] (w = (q - 8) * scale + zero)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    group_size: int | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def to(self, device) -> QuantizedParts:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedParts(move(self.q), move(self.scale), move(self.zero), self.group_size)

    @staticmethod
    def concat(parts: list[QuantizedParts]) -> QuantizedParts:
        zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
        return QuantizedParts(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zero, parts[0].group_size
        )


def prequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: CheckpointScheme
) -> Iterator[tuple[str, torch.Tensor | QuantizedParts]]:
    """HF-named (name, tensor) -> (name, tensor or QuantizedParts) with one `.weight` per projection."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf not in _QUANT_SUFFIXES and not (leaf == "weight" and module in pending):
            if leaf == "weight" and module.endswith("_proj"):
                pending.setdefault(module, {})[leaf] = tensor  # its scale may follow
                continue
            yield name, tensor
            continue
        pending.setdefault(module, {})[leaf] = tensor
        parts = _complete(pending[module], scheme)
        if parts is not None:
            del pending[module]
            yield f"{module}.weight", parts
    for module, tensors in pending.items():  # projections left in full precision (ignored by the recipe)
        if set(tensors) != {"weight"}:
            raise ValueError(f"{module} is missing tensors: it has only {', '.join(sorted(tensors))}")
        yield f"{module}.weight", tensors["weight"]


def _complete(t: dict[str, torch.Tensor], scheme: CheckpointScheme) -> torch.Tensor | QuantizedParts | None:
    """The projection's weight once all its tensors are here, else None."""
    if scheme.method == "fp8":
        if not {"weight", "weight_scale_inv"} <= t.keys():
            return None
        return _fp8_parts(t["weight"], t["weight_scale_inv"], scheme.block_size)
    needed = (
        {"weight_packed", "weight_scale", "weight_shape"}
        if scheme.format == "pack-quantized"
        else {"weight", "weight_scale"}
    )
    if not scheme.symmetric:
        needed.add("weight_zero_point")
    if not needed <= t.keys():
        return None
    if scheme.format == "pack-quantized":
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        shape = torch.Size(t["weight_shape"].tolist())
        q = unpack_from_int32(t["weight_packed"], scheme.num_bits, shape)
        zero_point = None
        if "weight_zero_point" in t:
            groups = t["weight_scale"].shape
            zero_point = unpack_from_int32(t["weight_zero_point"], scheme.num_bits, groups, packed_dim=0)
    else:
        q, zero_point = t["weight"], t.get("weight_zero_point")
    scale = t["weight_scale"].float()
    if scheme.scheme == "fp8":
        return QuantizedParts(q, scale.reshape(-1).expand(q.shape[0]).contiguous())
    if scheme.scheme == "int8":
        return QuantizedParts(q.to(torch.int8), scale.reshape(-1) if scheme.strategy == "channel" else scale)
    # int4: the checkpoint's q in [-8, 7] and w = (q - zp) * scale; ours q + 8 and zero = -zp * scale.
    zero = torch.zeros_like(scale) if zero_point is None else -zero_point.float() * scale
    return QuantizedParts((q.to(torch.int32) + 8), scale, zero, scheme.group_size)


def _fp8_parts(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None):
    if block is None:  # one scale per tensor: the same fp8 values, that scale on every row
        return QuantizedParts(q, scale_inv.float().reshape(-1).expand(q.shape[0]).contiguous())
    rows, cols = block
    scale = scale_inv.float().repeat_interleave(rows, 0)[: q.shape[0]].repeat_interleave(cols, 1)[:, : q.shape[1]]
    return q.float() * scale
