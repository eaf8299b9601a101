"""The error for a request the engine cannot serve as asked. Every layer that checks a request
raises it (the sampling parameters on construction, the grammar bounds, the engine against its
model), and every frontend maps it to its client error (HTTP 400, gRPC INVALID_ARGUMENT)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The caller asked for something the engine cannot do; the message says what."""
