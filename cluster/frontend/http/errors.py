"""HTTP errors: a RequestError's kind mapped to an HTTP status and OpenAI error type (the one
table; gRPC has its own), the frontend's own errors, and OpenAI-shaped error responses with
Retry-After on every 429 and 503."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from splitserve.cluster.frontend.openai.responses import error_body
from splitserve.cluster.request_error import ErrorKind

# The one table from a RequestError's kind to HTTP: (status, OpenAI error type).
HTTP_STATUS_BY_KIND: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID: (400, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (503, "server_error"),
    ErrorKind.DEADLINE: (504, "timeout_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}
RETRY_STATUSES = (429, 503)  # answered with Retry-After, always


class OpenAIHTTPError(Exception):
    """An error the frontend itself answers (unknown model, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param, self.code = status, message, error_type, param, code


def error_response(
    status: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    retry_after_s: float = 1.0,
) -> JSONResponse:
    if status in RETRY_STATUSES:
        headers = {"Retry-After": retry_after(retry_after_s), **(headers or {})}
    return JSONResponse(error_body(message, error_type, param, code), status_code=status, headers=headers)


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1 (RFC 9110 allows no fractions)."""
    return str(max(1, int(-(-seconds // 1))))
