"""BlockReservation: the prompt blocks a decode replica reserved and still has to receive."""

from __future__ import annotations

from typing import NamedTuple


class BlockReservation(NamedTuple):
    """Returned by LLMEngine.reserve_prompt_blocks. Ordered by destination block, so a run of
    ascending ids is received in place, with no unpacking."""

    block_indices: list[int]  # indices into the prompt's block list that must be received
    block_ids: list[int]  # the local blocks they go to, one per index
