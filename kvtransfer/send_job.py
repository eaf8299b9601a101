"""SendJob: one request's KV transfer as the prefill worker tracks it, whichever sender
(kvtransfer/kv_sender.py over torch.distributed, or the simulated engine's timed one) moves it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

__all__ = ["SendJob"]


@dataclass
class SendJob:
    """One request's transfer: which local blocks go to which peer under which tags."""

    request_id: str
    peer_id: str
    transfer_id: int
    block_ids: list[int]  # prefill-side block ids, in the order decode expects
    layerwise: bool
    done: Future = field(default_factory=Future)
    num_layers_sent: int = 0
    num_bytes: int = 0
    seconds: float = 0.0  # sender-thread time on this job: pack, post, final wait
    failed: bool = False
    num_blocks: int = 0  # blocks the receiver expects (len(block_ids) once they are bound)
    aborted: bool = False  # its prefill failed: the rest goes out as filler
    # True once an aborted job's every layer is out (the pair is in step), False if it broke.
    flushed: Future = field(default_factory=Future)
    # Posted sends, each holding its tensors until it completes.
    pending: list = field(default_factory=list, repr=False)
