"""Token bitmasks: one bit per vocabulary entry (bit i of int32 word i // 32 allows token i),
the layout xgrammar and llguidance both fill. Applying a whole batch's masks is a single
table lookup plus an add: each mask byte indexes a [256, 8] table of 0 / -inf rows."""

from __future__ import annotations

import torch

# Row b holds, for each of the 8 bits of byte value b, 0.0 (allowed) or -inf (masked).
_BITS = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
_ADD_TABLE = torch.zeros(256, 8).masked_fill_(_BITS == 0, float("-inf"))


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed [num_rows, words] int32 bitmask (contiguous: the libraries write into it)."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set every masked logit to -inf, in place, for the whole batch at once.

    logits [N, V] float, bitmask [N, ceil(V / 32)] int32 on the CPU. Ids at or past 32 * words
    (a model vocabulary padded beyond the tokenizer's) are masked too.
    """
    num_rows, vocab = logits.shape
    words = bitmask.shape[1]
    table = _ADD_TABLE if logits.dtype == torch.float32 else _ADD_TABLE.to(logits.dtype)
    # Little-endian int32 -> bytes keeps token order: byte j of word w holds ids 32w+8j .. +7.
    mask_bytes = bitmask.to(logits.device).contiguous().view(torch.uint8).to(torch.int32)
    add = table.to(logits.device)[mask_bytes].view(num_rows, words * 32)
    covered = min(vocab, words * 32)
    logits[:, :covered].add_(add[:, :covered])
    if vocab > covered:
        logits[:, covered:] = float("-inf")
    return logits
