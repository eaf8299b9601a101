"""The step mailbox: a CPU group's forwards handed to the followers through the shared-memory
segment of its collectives (shm_collectives.py) instead of a pipe header and a broadcast.

Why: rank 0 sends a step and starts its forward at once; a follower had to wake from its pipe,
unpickle the header, wait for the batch's broadcast and build the metadata's tensors first, so
it reached the step's first all-reduce 25-150 us after rank 0, which waited there
(bench/results/tensor_parallel.md). Through the mailbox the driver writes the whole forward --
sizes, ids, positions, slots, the rows whose logits follow, and the metadata's int32 tensors as
rank 0 built them -- into one of two buffers and publishes its number; a follower polling that
number copies the buffer out once and runs its forward on views of the copy.

Every other command (a forward with an extension's work, one too large for a buffer, logits,
host KV copies, the extension's commands) still goes over the pipe, tagged with the number of
forwards posted before it: a follower takes a pipe message tagged t right after forward t and
before forward t + 1, so it runs every command in the driver's order, whichever thread sent it.
A message written before forward t + 1 was posted is in the pipe once the follower sees t + 1's
number, so it drains the pipe before taking that forward.

A follower polls for _POLL_S after each command (the next step follows within a millisecond),
yielding its core between polls; then it parks: it sets its parked flag and blocks on its pipe
for up to _PARK_S, and a driver that posts a forward while a follower is parked writes it a WAKE
message. An idle engine's followers thus sleep (waking every _PARK_S to look again, the safety
net of the flag's handshake). The counters live in each rank's line of the segment: forwards
posted (rank 0's), forwards taken and parked (each follower's).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.parallel.shm_collectives import LINE_FIELDS, MAILBOX_BYTES, MAILBOX_FIELDS, ShmCollectives
from splitserve.engine.parallel.step_broadcast import FORWARD, STOP

WAKE = "wake"  # the driver's nudge to a parked follower (a pipe message that is no command)
_POSTED, _TAKEN, _PARKED = MAILBOX_FIELDS
# int64 words before the batch: tokens, sequences, table width, max query length, max context
# length, logits rows (-1: none announced), two spare.
_HEAD = 8
_POLL_S = 5e-3
_PARK_S = 50e-3
# A full barrier between a store and a later load of another counter (the parked-flag handshake:
# x86-64 may reorder exactly that pair): an uncontended lock's acquire and release are locked
# read-modify-writes (glibc semaphores), which drain the store buffer.
_BARRIER = threading.Lock()


def _full_barrier() -> None:
    with _BARRIER:
        pass


class MailboxForward(NamedTuple):
    """A forward as a follower takes it from the mailbox (its kind first, like a pipe header)."""

    kind: str
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None  # int64 rows of the output whose logits follow the forward
    rank_work: Any = None  # never: a forward with an extension's work goes over the pipe


def _layout(tokens: int, seqs: int, width: int, rows: int) -> tuple[int, int]:
    """The byte ends of the int64 part (head, ids, positions, slots, rows) and of the int32 part
    (query starts, context lengths, block tables)."""
    end64 = 8 * (_HEAD + 3 * tokens + max(rows, 0))
    return end64, end64 + 4 * (2 * seqs + 1 + seqs * width)


class StepMailbox:
    """The driver's side: post a forward (under the caller's lock: one poster at a time)."""

    def __init__(self, shm: ShmCollectives):
        self._shm = shm
        self._counters = shm.counters
        self._followers = list(range(1, shm.size))
        self.posted = 0  # forwards posted so far: the tag of every pipe message sent after them

    def post_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_rows: list[int] | None
    ) -> bool:
        """Write the forward into the next buffer and publish it; False (nothing posted) when it
        does not fit one (the caller sends it over the pipe)."""
        tokens = int(input_ids.shape[0])
        seqs, width = meta.block_tables.shape
        rows = len(logits_rows) if logits_rows else -1
        end64, end = _layout(tokens, seqs, width, rows)
        if end > MAILBOX_BYTES:
            return False
        number = self.posted + 1
        # The buffer's last reader: forward number - 2, which every follower has copied out long
        # before (the driver's forward number - 1 paired with theirs).
        self._shm.wait_for(_TAKEN, self._followers, number - 2, "step mailbox")
        buf = self._shm.mailbox(number & 1)
        head = torch.tensor([tokens, seqs, width, meta.max_query_len, meta.max_context_len, rows, 0, 0])
        parts = [head, input_ids, positions, meta.slot_mapping]
        if logits_rows:
            parts.append(torch.tensor(logits_rows, dtype=torch.int64))
        torch.cat(parts, out=buf[:end64].view(torch.int64))
        tables = meta.block_tables.reshape(-1)
        torch.cat([meta.query_start_loc, meta.context_lens, tables], out=buf[end64:end].view(torch.int32))
        self._counters[_POSTED] = number  # rank 0's line; TSO: the buffer is visible before it
        self.posted = number
        return True

    def parked(self) -> list[int]:
        """The followers parked now (they need a WAKE message): read after the post's store."""
        _full_barrier()
        return [r for r in self._followers if self._counters[r * LINE_FIELDS + _PARKED]]


class FollowerInbox:
    """A follower's side: its commands in the driver's order, forwards from the mailbox and the
    rest from its pipe."""

    def __init__(self, shm: ShmCollectives, conn: Connection):
        self._shm = shm
        self._conn = conn
        self._counters = shm.counters
        self._line = shm.rank * LINE_FIELDS
        self._taken = 0
        self._stash: collections.deque[tuple[int, Any]] = collections.deque()  # (tag, header)

    def next(self):
        """The next command's header (a MailboxForward for a posted forward). Raises EOFError
        when the driver closed the pipe."""
        deadline = time.monotonic() + _POLL_S
        while True:
            if self._stash and self._stash[0][0] <= self._taken:
                return self._stash.popleft()[1]
            if self._counters[_POSTED] > self._taken:
                if self._drain():  # a message sent before this forward was posted goes first
                    continue
                return self._take()
            if self._drain():
                continue
            if time.monotonic() < deadline:
                os.sched_yield()
            else:
                self._park()

    def _drain(self) -> bool:
        """Stash what the pipe holds now; True when a command came (not only WAKEs)."""
        came = False
        while self._conn.poll(0):
            message = self._conn.recv()
            if message == WAKE:
                continue
            came = True
            if message[0] == STOP:  # the driver's close: untagged, obeyed at once
                self._stash.appendleft((-1, message))
            else:
                self._stash.append(message)
        return came

    def _park(self) -> None:
        counters = self._counters
        counters[self._line + _PARKED] = 1
        _full_barrier()  # the flag is visible before the posted count is read again
        try:
            if counters[_POSTED] <= self._taken:
                self._conn.poll(_PARK_S)  # a WAKE, a pipe command, EOF, or the safety net's timeout
        finally:
            counters[self._line + _PARKED] = 0

    def _take(self) -> MailboxForward:
        number = self._taken + 1
        buf = self._shm.mailbox(number & 1)
        tokens, seqs, width, max_query_len, max_context_len, rows = buf[: 8 * _HEAD].view(torch.int64).tolist()[:6]
        end64, end = _layout(tokens, seqs, width, rows)
        data = buf[:end].clone()  # the buffer is the driver's again for forward number + 2
        self._counters[self._line + _TAKEN] = number
        self._taken = number
        ids, positions, slots, logits_rows = (
            data[8 * _HEAD : end64].view(torch.int64).split([tokens, tokens, tokens, max(rows, 0)])
        )
        starts, context_lens, tables = data[end64:end].view(torch.int32).split([seqs + 1, seqs, seqs * width])
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts,
            context_lens=context_lens,
            block_tables=tables.view(seqs, width),
            query_start_loc_cpu=starts.tolist(),
            context_lens_cpu=context_lens.tolist(),
            max_query_len=max_query_len,
            max_context_len=max_context_len,
        )
        return MailboxForward(FORWARD, ids, positions, meta, logits_rows if rows >= 0 else None)
