"""RequestError: why a request could not be served, as a protocol-neutral kind.

The control plane (dispatcher) and the shared frontend code (backend) raise it; each
frontend keeps one table from kind to its own codes (HTTP status + OpenAI error type in
frontend/http/api.py, grpc.StatusCode in frontend/grpc/server.py), as Dynamo's KV router
does: errors carry a kind, never an HTTP status. Imports nothing heavy (no torch, no ray).
"""

from __future__ import annotations

import enum

ECHO_CHARS = 100  # the most of a client's value an error message repeats back


def echoed(value: str) -> str:
    """value as an error message quotes it: repr'd, and cut to ECHO_CHARS (a 10 KB name would
    otherwise come back whole in every refusal and log line)."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


class ErrorKind(enum.StrEnum):
    """What went wrong, from the client's point of view (what it should do next)."""

    INVALID = "invalid"  # the request itself is bad: resending it unchanged fails again
    NOT_FOUND = "not_found"  # what it names does not exist here (an unknown model)
    OVERLOADED = "overloaded"  # admission refused it (queue or per-key cap full): retry later
    UNAVAILABLE = "unavailable"  # no replica can serve it right now (none ready, one died): retry
    DEADLINE = "deadline"  # it ran past its deadline; whatever it held on the replicas is freed
    INTERNAL = "internal"  # a bug or an unexpected replica failure


class RequestError(Exception):
    """A request-level failure. `kind` decides the status each frontend answers with;
    `retry_after_s` is the back-off a client is told for OVERLOADED / UNAVAILABLE."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        retry_after_s: float = 1.0,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.code = code  # a machine-readable reason where OpenAI has one (model_not_found)
        self.kind = ErrorKind(kind)
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param  # the request field at fault, where one is (HTTP's error body names it)

    def __repr__(self) -> str:
        return f"RequestError({self.kind.value!r}, {self.message!r})"

    @property
    def retryable(self) -> bool:
        return self.kind in (ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE)


def invalid(message: str, param: str | None = None) -> RequestError:
    return RequestError(ErrorKind.INVALID, message, param=param)
