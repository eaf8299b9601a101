"""Errors raised by the KV transport."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A pair could not be opened, or a send/recv failed or timed out.

    The pair involved is closed when this is raised (its stream is out of sync); reopen it
    with open_pair and a new epoch.
    """


class TransportUsageError(ValueError):
    """The transport was called with bad arguments (wrong device, layout, role, tag)."""


class TransferAbortedError(RuntimeError):
    """The sender gave up on a transfer (its prefill failed) but still completed the wire
    protocol with filler: the receiver's posted receives complete, the pair stays in step and
    usable by the other transfers on it. The receiver discards what it got."""
