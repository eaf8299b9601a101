"""The error every frontend maps to its own status codes (HTTP status, gRPC code)."""

from __future__ import annotations


class BackendError(Exception):
    """A request-level failure with the HTTP status and OpenAI error type to report."""

    def __init__(self, message: str, status: int, error_type: str = "server_error"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type


def invalid(message: str) -> BackendError:
    return BackendError(message, 400, "invalid_request_error")
