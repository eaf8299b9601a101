"""Why a tenant's request was refused, as HTTP and gRPC both answer it (OpenAI's codes)."""

from __future__ import annotations

from splitserve.cluster.request_error import echoed

# The one wording of a refused key, HTTP's guard and both frontends' tenant checks alike.
UNKNOWN_KEY_MESSAGE = "invalid or missing API key; send 'Authorization: Bearer <key>'"


class TenantRefusal(Exception):
    def __init__(self, status: int, code: str, error_type: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.code, self.error_type, self.message = status, code, error_type, message
        self.retry_after_s = retry_after_s
        self.headers: dict[str, str] = {}  # x-ratelimit-* of the tenant, set by the gate

    @classmethod
    def rate(cls, message: str, retry_after_s: float) -> TenantRefusal:
        return cls(429, "rate_limit_exceeded", "rate_limit_error", message, retry_after_s)

    @classmethod
    def quota(cls, message: str, retry_after_s: float) -> TenantRefusal:
        return cls(429, "insufficient_quota", "insufficient_quota", message, retry_after_s)

    @classmethod
    def unknown_key(cls) -> TenantRefusal:
        return cls(401, "invalid_api_key", "invalid_request_error", UNKNOWN_KEY_MESSAGE)

    @classmethod
    def tenant_removed(cls, name: str) -> TenantRefusal:
        return cls(401, "invalid_api_key", "invalid_request_error", f"the tenant {name!r} is no longer configured")

    @classmethod
    def model_not_allowed(cls, model: str) -> TenantRefusal:
        return cls(
            404,
            "model_not_found",
            "invalid_request_error",
            f"the model {echoed(model)} does not exist or you do not have access to it",
        )
