"""Chained block hashes over token ids: the one hash every process agrees on.

Algorithm (version 1, fixed; change HASH_VERSION if it ever changes):
  root        = blake2b(b"splitserve-block-hash-v1", digest_size=8, person=b"splitserve"), or
                with a seed (the model, where a deployment serves several: equal token ids of
                two models never hash equal) blake2b(b"splitserve-block-hash-v1\0" || seed), and
                for a request with a LoRA adapter blake2b(... || seed || b"\0lora\0" || adapter):
                its KV differs from the base's and every other adapter's on equal tokens
  block_hash  = blake2b(parent_hash (8 bytes, little-endian)
                        || token ids as little-endian uint32,
                        digest_size=8, person=b"splitserve")
  interpreted as an unsigned little-endian 64-bit int.
Only *full* blocks are hashed; the hash of block i covers every token of blocks 0..i through
the chain, so equal hashes mean equal prefixes. Pure Python, no torch: the router imports it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence

HASH_VERSION = 1
_PERSON = b"splitserve"


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(), "little")


ROOT_HASH = _digest(b"splitserve-block-hash-v1")


def root_hash(seed: str | None = None, lora_adapter: str | None = None) -> int:
    """The chain's root: ROOT_HASH, or one of its own for a seed (a model's served name) and
    for a LoRA adapter (its served name), so no prefix is shared across adapters or with the base."""
    if not seed and not lora_adapter:
        return ROOT_HASH
    data = b"splitserve-block-hash-v1\0" + (seed or "").encode()
    if lora_adapter:
        data += b"\0lora\0" + lora_adapter.encode()
    return _digest(data)


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash one full block given the hash of the block before it (ROOT_HASH for the first)."""
    try:
        payload = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    return _digest(payload)


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH, start_block: int = 0
) -> list[int]:
    """Hashes of every full block of token_ids, starting at block index start_block.

    parent_hash must be the hash of block start_block - 1 (ROOT_HASH when start_block is 0),
    so callers can extend an existing chain incrementally.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hashes: list[int] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent_hash = hash_block(parent_hash, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent_hash)
    return hashes


def extend_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
    """Append hashes for blocks of token_ids that became full since `hashes` was computed
    (root: the chain's root, root_hash(seed))."""
    parent = hashes[-1] if hashes else root
    new = hash_blocks(token_ids, block_size, parent, start_block=len(hashes))
    hashes.extend(new)
    return new


def count_prefix_hits(hashes: Iterable[int], contains: Callable[[int], bool]) -> int:
    """Number of leading hashes for which contains(hash) is true."""
    n = 0
    for h in hashes:
        if not contains(h):
            break
        n += 1
    return n
