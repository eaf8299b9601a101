"""Local or remote prefill, by measured cost (RouterConfig.prefill_placement "measured").

Once the router has picked a decode replica D (holding `decode_cached` of the prompt's P
tokens) and a prefill replica R (holding `prefill_cached`), the uncached remainder
P - decode_cached is prefilled either by D itself or by R, whose KV then moves to D. Each side
is priced in seconds of delay summed over the requests it touches, from the figures the
replicas report with their load (LoadReport: the engine's step cost profile,
engine/step_cost_profile.py, and the KV it sent):

  local  = queued_D * p_D                    # D's own queued prompt tokens go first
         + (decode_step_D if running_D > 0   # the prefill rides a step of D's running batch,
            else step_D)                     #   or is a step of its own
         + remainder * p_D                   # the prefill itself
         + running_D * remainder * p_D       # the stall: every running sequence waits for it
  remote = step_R                            # a step of R's
         + queued_R * p_R                    # R's queue
         + (P - prefill_cached) * p_R        # R's prefill of what it does not hold
         + max(handoff,                      # the hop, as the ingress measured it lately
               ceil(remainder / block_size) * kv_block_bytes_R / transfer_bytes_per_second_R)

where a prefilling step of a replica costs step + p * tokens, on the line of the forward that
replica would run for it (LoadReport.prefill_line): a fresh prompt -- nothing of it cached
there, and nothing queued or running there to share its step -- runs as a step of its own (on
CPU the scripted prefill, engine/model/prefill_graph.py) and is priced on the replica's fresh
line; a tail after a prefix hit, or a prompt that joins a running batch or a queue, runs the
eager forward, priced on the other line. One line over both kinds priced an idle decode
replica's 32-token tail by its costly first scripted prefill and sent it remote (issue 41).
Handoff is the median of the recent remote requests' `handoff` stage (decode/first_token_clock.py:
reserving blocks, the prefill call's round trip, the transfer's set-up and wire time; 0 until a
few were seen) -- the hop's fixed cost, which no replica's figures hold -- unless this prompt's
KV bytes take longer at the measured send throughput, and queued and running count the
requests routed there since its report (ReplicaLoad's pending counts). The lower wins, a tie
going local (no KV moves). Where a figure is not measured yet -- a cold replica: no prefill
step of either kind ran on it, or R sent no KV yet -- there is no cost: the router keeps its
threshold rule. Pure Python, no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from splitserve.cluster.routing.load import ReplicaLoad

LOCAL_CHEAPER = "local-prefill-cheaper"
REMOTE_CHEAPER = "remote-prefill-cheaper"


@dataclass(frozen=True)
class PlacementCost:
    """The two sides' priced delay, in seconds."""

    local_seconds: float
    remote_seconds: float

    @property
    def local_wins(self) -> bool:
        return self.local_seconds <= self.remote_seconds

    @property
    def reason(self) -> str:
        """The router's decision reason for this outcome."""
        return LOCAL_CHEAPER if self.local_wins else REMOTE_CHEAPER


def runs_alone(load: ReplicaLoad, num_uncached: int, num_tokens: int) -> bool:
    """The replica would prefill this prompt as a fresh prompt in a step of its own: none of it
    cached there, nothing queued or running there (routed since its report included)."""
    return num_uncached == num_tokens and load.effective_running == 0 and load.effective_queued_tokens == 0


def local_prefill_seconds(decode: ReplicaLoad, remainder: int, fresh: bool = False) -> float | None:
    """The decode replica prefilling `remainder` tokens inside its current batch (fresh: the
    whole prompt, alone in its step: runs_alone); None if it has no prefill measured yet."""
    report = decode.report
    line = report.prefill_line(fresh)
    if line is None:
        return None
    step, per_token = line
    running = decode.effective_running
    prefill = remainder * per_token
    batch_step = report.decode_step_seconds if running else step
    return decode.effective_queued_tokens * per_token + batch_step + prefill + running * prefill


def remote_prefill_seconds(
    prefill: ReplicaLoad,
    num_uncached: int,
    num_transfer_tokens: int,
    block_size: int,
    handoff_seconds: float = 0.0,
    fresh: bool = False,
) -> float | None:
    """The prefill replica's queue and its prefill of num_uncached tokens (fresh: the whole
    prompt, alone in its step: runs_alone), then the handoff (the measured hop, or the transfer
    of num_transfer_tokens' blocks if that takes longer); None if its prefill or its sending is
    not measured yet."""
    report = prefill.report
    line = report.prefill_line(fresh)
    if line is None or report.transfer_bytes_per_second <= 0 or report.kv_block_bytes <= 0:
        return None
    step, per_token = line
    num_blocks = math.ceil(num_transfer_tokens / block_size)
    transfer = num_blocks * report.kv_block_bytes / report.transfer_bytes_per_second
    compute = step + (prefill.effective_queued_tokens + num_uncached) * per_token
    return compute + max(handoff_seconds, transfer)


def placement_cost(
    decode: ReplicaLoad,
    prefill: ReplicaLoad,
    num_tokens: int,
    remainder: int,
    num_prefill_uncached: int,
    block_size: int,
    handoff_seconds: float = 0.0,
) -> PlacementCost | None:
    """Both sides' cost for a `num_tokens` prompt whose `remainder` tokens decode lacks and
    whose `num_prefill_uncached` tokens the prefill replica lacks; None where either is cold."""
    local = local_prefill_seconds(decode, remainder, runs_alone(decode, remainder, num_tokens))
    remote = remote_prefill_seconds(
        prefill,
        num_prefill_uncached,
        remainder,
        block_size,
        handoff_seconds,
        runs_alone(prefill, num_prefill_uncached, num_tokens),
    )
    if local is None or remote is None:
        return None
    return PlacementCost(local, remote)


class HandoffEstimate:
    """The median of the last WINDOW remote-prefill requests' measured handoff (seconds); 0.0
    until MIN_SAMPLES were seen. A median, not a mean: a replica pair's first transfer also sets
    up its connection (a process group), a one-off many times the usual hop."""

    WINDOW = 16
    MIN_SAMPLES = 3

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=self.WINDOW)

    def observe(self, seconds: float) -> None:
        if seconds >= 0:
            self._recent.append(seconds)

    @property
    def num_samples(self) -> int:
        return len(self._recent)

    @property
    def seconds(self) -> float:
        return statistics.median(self._recent) if len(self._recent) >= self.MIN_SAMPLES else 0.0
