"""Quantized weights under tensor parallelism: each rank holds exactly its slice of what TP 1
holds -- the same integers, the same scales -- so its shard computes what TP 1's rows or
columns compute, and the all-reduce adds the same terms TP 1's matmul adds.

- Column-parallel weights (q/k/v, gate/up: a rank's rows): a row's scale (int8, fp8) and its
  groups (int4) lie within the row, so the rank quantizes its rows as it reads them.
- Row-parallel weights (o, down: a rank's input columns): an int8/fp8 output channel's scale is
  the largest value over *all* its inputs, which a column slice does not see; the rank reads
  the whole tensor, quantizes it as TP 1 does and keeps its columns with every row's scale.
  int4 groups run along the inputs: a rank's columns are whole groups (shard_plan's
  check_quantized_split refuses a size where they are not), so it reads only its slice.
- Pre-quantized checkpoints (compressed-tensors, HF fp8): a projection's tensors (values or
  packed values, scales, zero points) are read whole and assembled as TP 1 assembles them,
  then cut: rows with their scales, or columns with their groups' scales (a per-channel scale
  whole on every rank).

Reading a row-parallel tensor whole costs each rank one full-precision weight at a time, not
the model (the layer-wise load keeps only the weights in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from splitserve.engine.config import ConfigError
from splitserve.engine.model.checkpoint import TensorSlice
from splitserve.engine.parallel.shard_plan import ShardPlan
from splitserve.engine.quant.prequantized_weights import QuantizedParts
from splitserve.engine.quant.quantize import PER_CHANNEL, quantize_parts

Piece = tuple[int, int, int]


def _pieces(cut: TensorSlice) -> list[Piece]:
    return [cut] if isinstance(cut, tuple) else cut


def _reads_whole(name: str, cut: TensorSlice, scheme: str, prequantized: bool) -> bool:
    """Whether a rank reads this sliced tensor whole and cuts it after quantizing or assembling."""
    if not name.startswith("model.layers."):
        return False  # embeddings and lm_head: never quantized
    if prequantized:
        return True  # its values, scales and zero points are cut together once assembled
    columns = any(dim == 1 for dim, _, _ in _pieces(cut))
    return scheme in PER_CHANNEL and columns and name.endswith(".weight")


def quantized_read_slice(plan: ShardPlan, scheme: str, prequantized: bool) -> Callable[[str], TensorSlice | None]:
    """iterate_weights' shard_slice for a quantized model: the plan's slice, or None (the whole
    tensor) where the rank must see all of it first."""

    def read(name: str) -> TensorSlice | None:
        cut = plan.checkpoint_slice(name)
        return None if cut is None or _reads_whole(name, cut, scheme, prequantized) else cut

    return read


def shard_quantized(
    weights: Iterable[tuple[str, torch.Tensor | QuantizedParts]], plan: ShardPlan, scheme: str, prequantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedParts]]:
    """Cut what quantized_read_slice read whole down to this rank's slice: an int8/fp8 weight
    quantized whole first (QuantizedParts), assembled pre-quantized parts as they are, any other
    tensor (a bias, a weight left in full precision) as a tensor."""
    for name, value in weights:
        cut = plan.checkpoint_slice(name)
        if cut is None or not _reads_whole(name, cut, scheme, prequantized):
            yield name, value
        elif isinstance(value, QuantizedParts):
            yield name, _cut_parts(name, value, cut, plan.size)
        elif scheme in PER_CHANNEL and name.endswith(".weight"):
            yield name, _cut_parts(name, quantize_parts(value, scheme), cut, plan.size)
        else:
            yield name, torch.cat([_cut(value, piece) for piece in _pieces(cut)], dim=_pieces(cut)[0][0])


def _cut(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    dim, start, stop = piece
    return tensor.narrow(dim, start, stop - start)


def _cut_parts(name: str, parts: QuantizedParts, cut: TensorSlice, size: int) -> QuantizedParts:
    pieces = [_cut_piece(name, parts, piece, size) for piece in _pieces(cut)]
    return pieces[0] if len(pieces) == 1 else QuantizedParts.concat(pieces)


def _cut_piece(name: str, parts: QuantizedParts, piece: Piece, size: int) -> QuantizedParts:
    dim, start, stop = piece
    if dim == 0:  # rows: each with its scale (and its groups' scales and zeros)
        zero = None if parts.zero is None else parts.zero[start:stop]
        return QuantizedParts(
            parts.q[start:stop].contiguous(), parts.scale[start:stop].contiguous(), zero, parts.group_size
        )
    q = parts.q[:, start:stop].contiguous()
    if parts.scale.dim() == 1:  # one scale per output channel: every rank keeps them all
        return QuantizedParts(q, parts.scale, parts.zero, parts.group_size)
    group = parts.q.shape[1] // parts.scale.shape[1]
    if start % group or stop % group:  # check_quantized_split refuses this before any load
        raise ConfigError(
            f"quantization groups of {group} inputs cannot be split over tensor_parallel_size {size}: "
            f"{name} has {parts.q.shape[1]} inputs, {stop - start} per rank"
        )
    columns = slice(start // group, stop // group)
    zero = None if parts.zero is None else parts.zero[:, columns].contiguous()
    return QuantizedParts(q, parts.scale[:, columns].contiguous(), zero, parts.group_size)
