"""int4 group sizes, torch-free: the tensor-parallel start-up check (engine/parallel/shard_plan.py)
reads them before any rank loads a weight."""

from __future__ import annotations

DEFAULT_GROUP_SIZE = 128
# Group sizes torch's int4 kernels take; a layer narrower than 128 uses the largest that divides it.
GROUP_SIZES = (128, 64, 32)


def group_size_for(in_features: int, preferred: int = DEFAULT_GROUP_SIZE) -> int:
    for size in (preferred, *GROUP_SIZES):
        if in_features % size == 0:
            return size
    raise ValueError(f"int4 needs in_features divisible by 32, got {in_features}")
