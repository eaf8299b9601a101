"""FollowerExtension: work a layer above the engine runs on each follower rank of a
tensor-parallel replica, beside the forward. The KV data plane is the one user
(kvtransfer/rank_kv_plane.py): each rank holds its own KV heads, so each rank sends (prefill)
or receives (decode) its own share of a transfer, on pairs of its own.

The engine knows nothing of what the work is. It carries three things between the driver and
the followers, all pickled over each follower's pipe (tp_ranks.py, tp_follower.py):
- a command (TensorParallelRanks.command), handled on the follower between forwards, in the
  order sent;
- a forward's work: an object riding on the step's own forward header, for which the follower
  builds that forward's per-layer callback (a layer-wise KV send follows its layers there as on
  the driver). The driver's per-layer callback names it by carrying a `rank_work` attribute;
- a reply (FollowerContext.reply), from any follower thread back to the driver's listener
  (TensorParallelRanks.listen).

An extension class is passed by reference (a spawned follower re-imports it), so it must be a
module-level name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class FollowerContext:
    rank: int
    size: int
    kv_cache: Any  # the rank's KVCache: its own KV heads of every block
    reply: Callable[[Any], None]  # to the driver's listener; thread-safe


class FollowerExtension(Protocol):
    def forward_hook(self, work: Any) -> Callable[[int], None] | None:
        """The per-layer callback of the forward that carries `work`."""
        ...

    def handle(self, command: Any) -> None:
        """A command from the driver, between forwards; it must not block for long (the next
        forward waits): slow work goes to the extension's own threads."""
        ...

    def close(self) -> None: ...


FollowerExtensionFactory = Callable[[FollowerContext], FollowerExtension]


def rank_work_of(on_layer_done: Any) -> Any:
    """The work a driver's per-layer callback hands the followers' same forward (None: none)."""
    return getattr(on_layer_done, "rank_work", None)
