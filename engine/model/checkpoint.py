"""Finding and reading the files of a Hugging Face checkpoint directory (torch-free until read)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A model directory that is missing files or holds weights the model cannot use."""


def require_model_dir(model_dir: str | Path) -> Path:
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"model directory {root} does not exist")
    if not (root / "config.json").is_file():
        raise CheckpointError(f"no config.json in {root}: not a Hugging Face checkpoint")
    return root


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: model.safetensors, or the shards of the index."""
    root = Path(model_dir)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{index_path} is not valid JSON: {exc}") from None
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise CheckpointError(f"{root} is missing shard(s) {', '.join(missing)} named in {INDEX_FILE}")
        return [root / s for s in shards]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    if list(root.glob("*.bin")) or list(root.glob("*.pth")):
        raise CheckpointError(f"{root} holds only PyTorch pickle weights; convert them to safetensors")
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")


# (dim, start, stop): rows (dim 0) or columns (dim 1) of a tensor; a list of them: those
# pieces joined along their dim (a fused tensor's q, k and v rows of one rank).
TensorSlice = tuple[int, int, int] | list[tuple[int, int, int]]


def iterate_weights(
    model_dir: str | Path, shard_slice: Callable[[str], TensorSlice | None] | None = None
) -> Iterator[tuple[str, object]]:
    """(hf_name, torch.Tensor on CPU) for every tensor in the checkpoint, shard by shard.

    shard_slice(name) -> a TensorSlice reads only that part of the tensor from the file (a
    tensor-parallel rank's slice; None: the whole tensor)."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    cut = shard_slice(name) if shard_slice is not None else None
                    if cut is None:
                        yield name, handle.get_tensor(name)
                        continue
                    part = handle.get_slice(name)
                    pieces = [cut] if isinstance(cut, tuple) else cut
                    read = [part[start:stop] if dim == 0 else part[:, start:stop] for dim, start, stop in pieces]
                    yield name, read[0] if len(read) == 1 else _join(read, pieces[0][0])
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None


def _join(parts: list, dim: int):
    """torch.cat(parts, dim) through tensor methods only (this module stays torch-free to import)."""
    shape = list(parts[0].shape)
    shape[dim] = sum(part.shape[dim] for part in parts)
    joined = parts[0].new_empty(shape)
    offset = 0
    for part in parts:
        joined.narrow(dim, offset, part.shape[dim]).copy_(part)
        offset += part.shape[dim]
    return joined
