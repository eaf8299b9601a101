"""The step mailbox: a CPU group's forwards handed to the followers through the shared-memory
segment of its collectives (shm_collectives.py) instead of a pipe header and a broadcast.

Why: rank 0 sends a step and starts its forward at once; a follower had to wake from its pipe,
unpickle the header, wait for the batch's broadcast and build the metadata's tensors first, so
it reached the step's first all-reduce 25-150 us after rank 0, which waited there
(bench/results/tensor_parallel.md). Through the mailbox the driver writes the whole forward --
sizes, ids, positions, slots, the rows whose logits follow, and the metadata's int32 tensors as
rank 0 built them -- into one of two buffers and publishes its number; a follower polling that
number runs its forward on views of the buffer (the driver writes that buffer again two
forwards later, once the follower has said it is done with it).

Every other command (a forward with an extension's work, one too large for a buffer, logits,
host KV copies, the extension's commands) still goes over the pipe, tagged with the number of
forwards posted before it: a follower takes a pipe message tagged t right after forward t and
before forward t + 1, so it runs every command in the driver's order, whichever thread sent it.
The driver also counts the tagged messages it has written: a follower that sees forward t + 1's
number reads that count after it and receives every message counted before it takes the
forward, so its spin reads counters only and never polls the pipe (a syscall that cost more
than the rest of taking a forward).

A follower polls for _POLL_S after each command (the next step follows within a millisecond),
yielding its core between polls; then it parks: it sets its parked flag and blocks on its pipe
for up to _PARK_S, and a driver that posts a forward while a follower is parked writes it a WAKE
message. An idle engine's followers thus sleep (waking every _PARK_S to look again, the safety
net of the flag's handshake). The counters live in each rank's line of the segment: forwards
posted and tagged messages sent (rank 0's), forwards taken and parked (each follower's).
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
# In rank 0's line, whose _TAKEN field no follower reads: the pipe messages it sent with a tag.
# A follower compares it with those it received, so its spin reads two counters and makes no
# syscall to look at the pipe (a poll of it costs more than the rest of a take).
_SENT = _TAKEN
# int64 words before the batch: tokens, sequences, table width, max query length, max context
# length, logits rows (-1: none announced), two spare.
_HEAD = 8
_POLL_S = 5e-3
_PARK_S = 50e-3
_MAX_VIEWS = 64
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
        self._buffers = [shm.mailbox(0), shm.mailbox(1)]
        self._heads = [b[: 8 * _HEAD].view(torch.int64).numpy() for b in self._buffers]
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # steps repeat their layouts
        self.posted = 0  # forwards posted so far: the tag of every pipe message sent after them
        self._sent = 0

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
        buf = number & 1
        # The buffer's last reader: forward number - 2, which every follower has finished: the
        # driver's forward number - 1 paired with theirs.
        self._shm.wait_for(_TAKEN, self._followers, number - 2, "step mailbox")
        key = (buf, end64, end)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            data = self._buffers[buf]
            views = self._views[key] = (data[8 * _HEAD : end64].view(torch.int64), data[end64:end].view(torch.int32))
        self._heads[buf][:6] = (tokens, seqs, width, meta.max_query_len, meta.max_context_len, rows)
        parts = [input_ids, positions, meta.slot_mapping]
        if logits_rows:
            parts.append(torch.tensor(logits_rows, dtype=torch.int64))
        torch.cat(parts, out=views[0])
        torch.cat([meta.query_start_loc, meta.context_lens, meta.block_tables.reshape(-1)], out=views[1])
        self._counters[_POSTED] = number  # rank 0's line; TSO: the buffer is visible before it
        self.posted = number
        return True

    def message_sent(self) -> None:
        """Count a tagged pipe message, once it is written to every follower."""
        self._sent += 1
        self._counters[_SENT] = self._sent

    def parked(self) -> list[int]:
        """The followers parked now (they need a WAKE message): read after the post's store."""
        _full_barrier()
        return [r for r in self._followers if self._counters[r * LINE_FIELDS + _PARKED]]


class FollowerInbox:
    """A follower's side: its commands in the driver's order, forwards from the mailbox and the
    rest from its pipe. A forward's tensors are views of the mailbox's buffer: the forward is
    done with them when the follower asks for its next command, which tells the driver so."""

    def __init__(self, shm: ShmCollectives, conn: Connection):
        self._conn = conn
        self._counters = shm.counters
        self._line = shm.rank * LINE_FIELDS
        self._buffers = [shm.mailbox(0), shm.mailbox(1)]
        self._heads = [b[: 8 * _HEAD].view(torch.int64).numpy() for b in self._buffers]
        self._views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._taken = 0
        self._received = 0  # tagged pipe messages
        self._stash: collections.deque[tuple[int, Any]] = collections.deque()  # (tag, header)

    def next(self):
        """The next command's header (a MailboxForward for a posted forward). Raises EOFError
        when the driver closed the pipe."""
        counters = self._counters
        counters[self._line + _TAKEN] = self._taken  # the last forward's buffer is free again
        deadline = time.monotonic() + _POLL_S
        while True:
            if self._stash and self._stash[0][0] <= self._taken:
                return self._stash.popleft()[1]
            posted = counters[_POSTED]
            # Read after posted (loads are not reordered on x86-64): every message sent before
            # that forward is counted, and in the pipe.
            sent = counters[_SENT]
            if sent > self._received:
                self._receive(sent)
            elif posted > self._taken:
                return self._take()
            elif time.monotonic() < deadline:
                os.sched_yield()
            else:
                self._park()

    def _receive(self, sent: int) -> None:
        """Stash tagged messages until sent of them came (they are in the pipe)."""
        while self._received < sent:
            if self._keep(self._conn.recv()):
                return  # a stop: obeyed at once

    def _keep(self, message) -> bool:
        """Stash message; True for the driver's stop (untagged, put first)."""
        if message == WAKE:
            return False
        if message[0] == STOP:
            self._stash.appendleft((-1, message))
            return True
        self._stash.append(message)
        self._received += 1
        return False

    def _park(self) -> None:
        counters = self._counters
        counters[self._line + _PARKED] = 1
        _full_barrier()  # the flag is visible before the counters are read again
        try:
            if counters[_POSTED] > self._taken or counters[_SENT] > self._received:
                return
            if self._conn.poll(_PARK_S):  # a WAKE, a pipe message, EOF, or the safety net's timeout
                while self._conn.poll(0) and not self._keep(self._conn.recv()):
                    pass  # what woke it (EOFError: the driver closed its end)
        finally:
            counters[self._line + _PARKED] = 0

    def _take(self) -> MailboxForward:
        number = self._taken + 1
        buf = number & 1
        tokens, seqs, width, max_query_len, max_context_len, rows = self._heads[buf][:6].tolist()
        key = (buf, tokens, seqs, width, rows)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            views = self._views[key] = self._slice(self._buffers[buf], tokens, seqs, width, rows)
        self._taken = number
        ids, positions, slots, logits_rows, starts, context_lens, tables = views
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts,
            context_lens=context_lens,
            block_tables=tables,
            query_start_loc_cpu=starts.tolist(),
            context_lens_cpu=context_lens.tolist(),
            max_query_len=max_query_len,
            max_context_len=max_context_len,
        )
        return MailboxForward(FORWARD, ids, positions, meta, logits_rows if rows >= 0 else None)

    @staticmethod
    def _slice(data: torch.Tensor, tokens: int, seqs: int, width: int, rows: int) -> tuple[torch.Tensor, ...]:
        end64, end = _layout(tokens, seqs, width, rows)
        words = data[:end64].view(torch.int64)
        ints = data[end64:end].view(torch.int32)
        at = [_HEAD + k * tokens for k in range(4)]
        return (
            words[at[0] : at[1]],
            words[at[1] : at[2]],
            words[at[2] : at[3]],
            words[at[3] :],
            ints[: seqs + 1],
            ints[seqs + 1 : 2 * seqs + 1],
            ints[2 * seqs + 1 :].view(seqs, width),
        )
